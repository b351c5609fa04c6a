"""Prefill and decode schedulers (one process, the in-process memcpy engine, real ZMQ
control) with every decode reserve landing in the landing area: greedy outputs equal the
colocated engine's for plain, feature and draft-state hand-offs at page sizes 1 and 16,
with decode's prefix reuse; the area returns to full after successes, a client abort
(only once prefill acknowledged) and when it is busy (those requests are written into
their slots directly)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.disagg.decode_side import decode_scheduler
from pdserve.disagg.handoff import Phase
from pdserve.disagg.prefill_side import prefill_scheduler
from pdserve.requests import RequestBuilder
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.req import samples_from_message
from tests.disagg.test_pd_schedulers import GREEDY, build_pd_models, pools_full, prompts, run_pair, sched, step_until
from tests.waiting import wait_until

@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return build_pd_models(tmp_path_factory.mktemp("pd-landing"))


ALWAYS_LAND = {"disaggregation_kv_landing_min_run": 10**9}  # any reserve of 2+ slots lands


def pair(dirs, p_algo: str | None, d_algo: str | None, extra: dict[str, Any], decode_extra: dict[str, Any]):
    shares = d_algo is not None and p_algo == d_algo
    p = sched(prefill_scheduler, dirs, p_algo, {**extra, "chunked_prefill_size": -1 if shares else 16})
    d = sched(decode_scheduler, dirs, d_algo, {**extra, **decode_extra},
              fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    return p, d


def colocated(make_engine, dirs, ps: list[list[int]]) -> list[list[int]]:
    """The colocated engine's greedy outputs (the reference)."""
    return [r["output_ids"] for r in make_engine(dirs["target"]).generate(input_ids=ps, sampling_params=GREEDY)]


def landing_full(d) -> None:
    state = d.mode.landing_state()
    assert state["free_bytes"] == state["capacity_bytes"] > 0 and state["pieces"] == 0, state


@pytest.mark.parametrize("p_algo,d_algo,extra", [
    (None, None, {"page_size": 1}),
    (None, None, {"page_size": 16}),
    ("EAGLE", "EAGLE", {"page_size": 1}),
    (None, "EAGLE3", {"page_size": 1}),
    ("EAGLE3", None, {"page_size": 16}),
], ids=["plain-page1", "plain-page16", "eagle-draft-state", "plain-to-eagle3-features", "eagle3-to-plain"])
def test_landed_transfers_equal_colocated(make_engine, dirs, p_algo, d_algo, extra):
    ps = prompts(6, seed=3)
    ref = colocated(make_engine, dirs, ps)
    p, d = pair(dirs, p_algo, d_algo, extra, ALWAYS_LAND)
    try:
        assert run_pair(p, d, ps) == ref
        assert d.mode.landed_requests == len(ps)  # every reserve landed, and unpacked right
        if d_algo:
            sent, received = p.mode.manager.bytes_by_kind, d.mode.bytes_by_kind
            assert sent == received, (sent, received)
            shares = p_algo == d_algo
            assert (sent["draft_kv"] > 0, sent["features"] > 0) == (shares, not shares), sent
        # Longer prompts: decode serves each one's cached prefix itself and lands the rest.
        longer = [ids + [7 + i, 11, 13 + i, 17, 19] for i, ids in enumerate(ps)]
        ref = colocated(make_engine, dirs, longer)
        hits = d.mode.prefix_hit_tokens
        assert run_pair(p, d, longer) == ref
        assert d.mode.prefix_hit_tokens > hits and d.mode.landed_requests == 2 * len(ps)
        landing_full(d)
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_a_busy_landing_area_means_direct_writes(make_engine, dirs):
    ps = prompts(4, seed=5)
    ref = colocated(make_engine, dirs, ps)
    p, d = pair(dirs, None, None, {"page_size": 1}, ALWAYS_LAND)
    area = d.mode.landing
    try:
        everything = area.take(area.capacity)
        assert run_pair(p, d, ps) == ref
        assert d.mode.landed_requests == 0
        area.give(everything)
        landing_full(d)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_no_landing_area_with_zero_mib(make_engine, dirs):
    ps = prompts(3, seed=6)
    ref = colocated(make_engine, dirs, ps)
    p, d = pair(dirs, None, None, {"page_size": 1}, {**ALWAYS_LAND, "disaggregation_kv_landing_mib": 0})
    try:
        assert d.mode.landing is None and d.mode.manager.landing is None
        assert run_pair(p, d, ps) == ref
        assert d.mode.landing_state() == {"capacity_bytes": 0, "free_bytes": 0, "pieces": 0, "landed_requests": 0}
    finally:
        p.close()
        d.close()


def test_an_aborted_landed_request_keeps_its_piece_until_prefill_acknowledges(dirs):
    p, d = pair(dirs, None, None, {"page_size": 1}, ALWAYS_LAND)
    builder = RequestBuilder(None, 4096, 10**6, 4, 0)
    try:
        r = samples_from_message(builder.group(list(range(6, 40)), SamplingParams.from_dict(GREEDY), False, 0,
                                                rid="x"))[0]
        r.bootstrap_host, r.bootstrap_port, r.bootstrap_room = "127.0.0.1", 1, 77
        d.add(r)
        step_until(d, lambda: d.mode.handoffs.count(Phase.RECEIVING))
        assert d.mode.landing.pieces == 1  # admitted with a piece
        wait_until(lambda: p.mode.manager.rooms.get(77) is not None, 5, step=0.01)
        (done,) = d.abort("x")
        assert done.finish.message == "aborted by the client"
        assert d.mode.handoffs.count(Phase.QUARANTINED) and d.mode.landing.pieces == 1, \
            "the piece was given back before prefill confirmed no write is in flight"
        wait_until(lambda: not d.mode.handoffs.count(Phase.QUARANTINED), 5, step=0.01,
                   between=lambda: (p.step(), d.step()))
        landing_full(d)
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()
