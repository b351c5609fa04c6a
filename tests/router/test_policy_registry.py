"""The router's policy registry (pdserve/router/policies.py): a name resolves to its class,
an unknown name is refused listing the known ones, the flags' choices come from the
registry, and what a policy needs (the request's key, its options) is read from its class."""

from __future__ import annotations

import random

import pytest

from pdserve.router import policies
from pdserve.router.config import POLICIES, ConfigError, from_cli
from pdserve.router.policies import (POLICY_CLASSES, POLICY_NAMES, CacheAware, PolicyOptions, RoundRobin,
                                     make_policy, policy_class)

pytestmark = pytest.mark.fast

PD = ["--pd-disaggregation", "--prefill", "http://10.0.0.1:30001", "--decode", "http://10.0.0.2:30002"]


def test_a_name_resolves_to_its_class():
    assert policy_class("round_robin") is RoundRobin and policy_class("cache_aware") is CacheAware
    for name, cls in POLICY_CLASSES.items():
        assert cls.name == name
        assert isinstance(make_policy(name), cls)


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown policy 'sticky'") as err:
        make_policy("sticky")
    for name in POLICY_NAMES:
        assert name in str(err.value)


def test_the_flag_choices_and_validation_come_from_the_registry():
    assert POLICIES == POLICY_NAMES == tuple(POLICY_CLASSES)
    with pytest.raises(ConfigError, match="--decode-policy"):
        from_cli([*PD, "--decode-policy", "sticky"])


def test_what_a_policy_needs_is_read_from_its_class():
    assert CacheAware.needs_key and not RoundRobin.needs_key
    assert [n for n, c in POLICY_CLASSES.items() if c.needs_key] == ["cache_aware"]
    pol = make_policy("cache_aware", threshold=0.25, balance_abs_threshold=3, max_tree_size=64)
    assert (pol.threshold, pol.balance_abs_threshold, pol.tree.max_size) == (0.25, 3, 64)
    rng = random.Random(0)
    assert make_policy("random", rng=rng)._rng is rng
    assert make_policy("power_of_two", rng=rng)._rng is rng


def test_a_new_policy_is_one_class_and_one_registry_line(monkeypatch):
    class First:
        name = "first"
        needs_key = False

        @classmethod
        def from_options(cls, opts: PolicyOptions) -> "First":
            return cls()

        def pick(self, candidates, key=None):
            return candidates[0]

        def remove_worker(self, url: str) -> None:
            pass

    monkeypatch.setitem(POLICY_CLASSES, "first", First)
    assert isinstance(policies.make_policy("first"), First)
