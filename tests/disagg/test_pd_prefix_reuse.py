"""Multi-turn across the split: a decode server keeps finished requests' KV in its prefix
cache and asks prefill only for the prompt positions it lacks. Greedy outputs stay the
colocated engine's for every prefill x decode speculative cell, page sizes 1 and 16, and
when decode lost the prefix between turns; the bytes and hits add up exactly; aborts and
failures of a request with a cached prefix release exactly its pages."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pdserve.disagg import protocol as P
from pdserve.requests import RequestBuilder
from pdserve.sampling_params import SamplingParams
from pdserve.disagg.decode_side import decode_scheduler
from pdserve.disagg.handoff import Phase
from pdserve.disagg.prefill_side import prefill_scheduler
from pdserve.scheduler.req import samples_from_message
from tests.disagg.test_pd_schedulers import PD_CELLS, GREEDY, dirs, pools_full, run_pair, sched, step_until  # noqa: F401
from tests.waiting import wait_until


def first_turns(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 90) for _ in range(rng.randrange(20, 60))] for _ in range(n)]


def second_turns(turn1: list[list[int]], answers: list[list[int]], seed: int) -> list[list[int]]:
    """Turn 2's prompt: turn 1's prompt, its answer, a new message."""
    rng = random.Random(seed)
    return [p + a + [rng.randrange(6, 90) for _ in range(rng.randrange(3, 12))] for p, a in zip(turn1, answers)]


def pair(dirs, p_algo: str | None, d_algo: str | None, extra: dict[str, Any], d_extra: dict[str, Any] | None = None):
    p = sched(prefill_scheduler, dirs, p_algo, {**extra, "chunked_prefill_size": 16})
    d = sched(decode_scheduler, dirs, d_algo, {**extra, **(d_extra or {})},
              fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    return p, d


def cached_len(d, ids: list[int]) -> int:
    return d.kv.matched_len(ids)


@PD_CELLS
def test_second_turn_hits_decode_cache_and_equals_colocated(make_engine, dirs, p_algo, d_algo, extra):
    turn1 = first_turns(4, seed=1)
    engine = make_engine(dirs["target"], **extra)
    answers = [r["output_ids"] for r in engine.generate(input_ids=turn1, sampling_params=GREEDY)]
    turn2 = second_turns(turn1, answers, seed=2)
    ref = [r["output_ids"] for r in engine.generate(input_ids=turn2, sampling_params=GREEDY)]
    p, d = pair(dirs, p_algo, d_algo, extra)
    try:
        assert run_pair(p, d, turn1) == answers
        bytes1, sent1 = d.mode.payload_bytes, P.payload_bytes(p.mode.manager.bytes_by_kind)
        per_position = d.mode.bytes_per_position(p_algo is not None and p_algo == d_algo)  # draft KV or features
        assert bytes1 == sum(len(t) for t in turn1) * per_position and d.mode.prefix_hit_tokens == 0
        # What decode holds of each turn-2 prompt: turn 1's prompt and answer (page aligned).
        ps = d.page_size
        expect = [cached_len(d, t) for t in turn2]
        assert all(e >= (len(a) + len(b) - 1) // ps * ps for e, a, b in zip(expect, turn1, answers))
        assert run_pair(p, d, turn2) == ref
        assert d.mode.prefix_hit_tokens == sum(expect)
        assert d.mode.payload_bytes - bytes1 == sum(len(t) - e for t, e in zip(turn2, expect)) * per_position
        # Prefill wrote only what decode lacked: fewer bytes than turn 2's whole prompts.
        sent2 = P.payload_bytes(p.mode.manager.bytes_by_kind) - sent1
        assert 0 < sent2 < sent1 * sum(map(len, turn2)) / sum(map(len, turn1))
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_reuse_off_and_evicted_prefix_send_everything(make_engine, dirs):
    turn1 = first_turns(3, seed=3)
    engine = make_engine(dirs["target"])
    answers = [r["output_ids"] for r in engine.generate(input_ids=turn1, sampling_params=GREEDY)]
    turn2 = second_turns(turn1, answers, seed=4)
    ref = [r["output_ids"] for r in engine.generate(input_ids=turn2, sampling_params=GREEDY)]
    for d_extra in ({"disable_decode_prefix_reuse": True}, {}):
        p, d = pair(dirs, None, "EAGLE", {}, d_extra)
        try:
            assert run_pair(p, d, turn1) == answers
            if not d_extra:
                assert d.flush_cache()  # decode lost the prefix between the turns
            before = d.mode.payload_bytes
            assert run_pair(p, d, turn2) == ref
            assert d.mode.prefix_hit_tokens == 0
            assert d.mode.payload_bytes - before == sum(map(len, turn2)) * d.mode.bytes_per_position()
            pools_full(p)
            pools_full(d)
        finally:
            p.close()
            d.close()


@pytest.mark.parametrize("page_size", [1, 16])
def test_partly_evicted_prefix_sends_the_rest(make_engine, dirs, page_size):
    """Pressure evicted the tail of what decode cached (least recently used leaves go
    first): turn 2 reuses the part still cached and receives everything after it."""
    turn1 = first_turns(3, seed=8)
    engine = make_engine(dirs["target"], page_size=page_size)
    answers = [r["output_ids"] for r in engine.generate(input_ids=turn1, sampling_params=GREEDY)]
    turn2 = second_turns(turn1, answers, seed=9)
    ref = [r["output_ids"] for r in engine.generate(input_ids=turn2, sampling_params=GREEDY)]
    p, d = pair(dirs, None, "EAGLE", {"page_size": page_size})
    try:
        run_pair(p, d, turn1)
        full = [cached_len(d, t) for t in turn2]
        evicted = d.kv.cache.evict(sum(full) // page_size // 2)
        assert evicted > 0
        left = [cached_len(d, t) for t in turn2]
        assert sum(left) < sum(full)
        before = d.mode.payload_bytes
        assert run_pair(p, d, turn2) == ref
        assert d.mode.payload_bytes - before == sum(len(t) - h for t, h in zip(turn2, left)) * d.mode.bytes_per_position()
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_whole_prompt_cached_transfers_nothing(make_engine, dirs):
    """A prompt decode holds entirely (a repeat of turn 1's prompt + answer): zero
    positions cross, the first token still comes from prefill."""
    turn1 = first_turns(2, seed=5)
    engine = make_engine(dirs["target"])
    answers = [r["output_ids"] for r in engine.generate(input_ids=turn1, sampling_params=GREEDY)]
    repeat = [p + a[:-1] for p, a in zip(turn1, answers)]  # every position's KV was computed
    ref = [r["output_ids"] for r in engine.generate(input_ids=repeat, sampling_params=GREEDY)]
    p, d = pair(dirs, None, None, {})
    try:
        run_pair(p, d, turn1)
        assert [cached_len(d, t) for t in repeat] == [len(t) for t in repeat]
        before, sent = d.mode.payload_bytes, P.payload_bytes(p.mode.manager.bytes_by_kind)
        assert run_pair(p, d, repeat) == ref
        assert d.mode.payload_bytes == before and P.payload_bytes(p.mode.manager.bytes_by_kind) == sent
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_abort_and_failure_with_a_cached_prefix_release_exactly_their_pages(make_engine, dirs):
    """The prefix stays locked while the request transfers (it cannot be evicted), an abort
    quarantines only the transferred pages, and afterwards the prefix is still cached and
    every other page is free."""
    turn1 = first_turns(1, seed=6)
    engine = make_engine(dirs["target"])
    answers = [r["output_ids"] for r in engine.generate(input_ids=turn1, sampling_params=GREEDY)]
    turn2 = second_turns(turn1, answers, seed=7)[0]
    p, d = pair(dirs, None, None, {})
    builder = RequestBuilder(None, 4096, 10**6, 4, 0)
    try:
        run_pair(p, d, turn1)
        hit = cached_len(d, turn2)
        assert hit > 0
        for room, end in ((501, "client abort"), (502, "prefill failure")):
            r = samples_from_message(builder.group(turn2, SamplingParams.from_dict(GREEDY), False, 0,
                                                    rid=f"r{room}"))[0]
            r.bootstrap_host, r.bootstrap_port, r.bootstrap_room = "127.0.0.1", 1, room
            d.add(r)  # prefill never gets this request: the room waits for it
            step_until(d, lambda: d.mode.handoffs.count(Phase.RECEIVING))
            assert d.mode.handoffs.get(room).first_position == hit
            # Locked: nothing of the prefix is evictable while the request holds it.
            assert d.kv.cache.evict(10**6) == 0 or cached_len(d, turn2) == hit
            assert cached_len(d, turn2) == hit
            wait_until(lambda: p.mode.manager.rooms.get(room) is not None, 5, step=0.01)
            if end == "client abort":
                (done,) = d.abort(f"r{room}")
            else:
                p.mode.manager.abort(room, "injected prefill failure")
                step_until(d, lambda: r.finish is not None)
                done = r
            assert done.finish.kind.value == "abort"
            h = d.mode.handoffs.get(room)
            assert h.phase is Phase.QUARANTINED
            # Only the pages past the cached prefix are kept out of use.
            assert h.held_pages.numel() == -(-(len(turn2) - hit) // d.page_size)
            wait_until(lambda: not d.mode.handoffs.count(Phase.QUARANTINED), 10, step=0.01,
                       between=lambda: (p.step(), d.step()))
            p.step()
            assert cached_len(d, turn2) == hit  # the prefix survived, unlocked
            m = d.memory_state()
            assert m["kv_pages_free"] + m["kv_pages_evictable"] == m["kv_pages_total"], m
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()
