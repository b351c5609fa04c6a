"""Worker selection policies and the prefix tree behind cache_aware."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pdserve.router.policies import CacheAware, PowerOfTwo, RandomPolicy, RoundRobin, make_policy
from pdserve.router.prefix_tree import PrefixTree

pytestmark = pytest.mark.fast


@dataclass
class W:
    url: str
    in_flight: int = 0


def test_round_robin_cycles_in_order():
    ws = [W("a"), W("b"), W("c")]
    rr = RoundRobin()
    assert [rr.pick(ws).url for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]


def test_random_covers_all_workers():
    ws = [W("a"), W("b"), W("c")]
    pol = RandomPolicy(random.Random(0))
    assert {pol.pick(ws).url for _ in range(100)} == {"a", "b", "c"}


def test_power_of_two_picks_the_less_loaded_of_its_two():
    ws = [W("a", 5), W("b", 0), W("c", 9)]
    pol = PowerOfTwo(random.Random(1))
    picks = [pol.pick(ws).url for _ in range(300)]
    # Never the most loaded (it always loses its comparison), and mostly the idle one.
    assert "c" not in picks
    assert picks.count("b") > picks.count("a")
    assert PowerOfTwo().pick([W("only", 3)]).url == "only"


def test_cache_aware_follows_prefixes_and_spreads_new_ones():
    ws = [W("a"), W("b")]
    pol = CacheAware(threshold=0.5, balance_abs_threshold=4)
    first = pol.pick(ws, "system prompt: you are helpful. question one")
    other = pol.pick(ws, "a completely different conversation")
    assert first.url != other.url  # new prefixes go to the least loaded / next in turn
    for _ in range(5):
        assert pol.pick(ws, "system prompt: you are helpful. question two").url == first.url
    assert pol.pick(ws, "a completely different conversation, continued").url == other.url
    # Token ids work the same way.
    t = pol.pick(ws, tuple(range(100)))
    assert pol.pick(ws, tuple(range(90)) + (7, 7)).url == t.url


def test_cache_aware_below_threshold_goes_to_least_loaded():
    a, b = W("a", 0), W("b", 3)
    pol = CacheAware(threshold=0.5, balance_abs_threshold=32)
    pol.tree.insert("abcdefghij", "b")
    assert pol.pick([a, b], "abcdefghij").url == "b"          # full match: affinity
    assert pol.pick([a, b], "abcXXXXXXXXXXXXXXXXX").url == "a"  # 3/20 matched: least loaded


def test_cache_aware_load_guard():
    a, b = W("a", 0), W("b", 0)
    pol = CacheAware(threshold=0.5, balance_abs_threshold=2)
    pol.tree.insert("shared prefix", "b")
    b.in_flight = 2
    assert pol.pick([a, b], "shared prefix").url == "b"  # 2 above the minimum: still allowed
    b.in_flight = 3
    assert pol.pick([a, b], "shared prefix").url == "a"  # 3 above: the guard sends it elsewhere
    assert pol.pick([a, b], None).url == "a"


def test_make_policy_names():
    for name in ("round_robin", "random", "power_of_two", "cache_aware"):
        assert make_policy(name).name == name


def test_prefix_tree_match_split_and_eviction():
    t = PrefixTree(max_size=100)
    t.insert("hello world", "a")
    t.insert("hello there", "b")
    assert t.match("hello world!") == {"a": 11, "b": 6}
    assert t.match("hello") == {"a": 5, "b": 5}
    assert t.match("goodbye") == {}
    t.insert("hello", "c")
    assert t.match("hello world") == {"a": 11, "b": 6, "c": 5}
    assert t.size == len("hello world") + len("there")
    # Past the bound, the least recently used leaves go first.
    for i in range(30):
        t.insert(f"key{i:02d}-" + "x" * 5, "a")
    assert t.size <= 100
    assert t.match("key29-xxxxx").get("a") == 11
    assert t.match("hello world") .get("a", 0) < 11
