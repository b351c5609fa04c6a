"""Prefill and decode schedulers wired through the transfer managers in one process (the
in-process memcpy engine, real ZMQ control sockets): greedy outputs equal the colocated
engine's for plain and speculative pairs, page sizes 1 and 16, chunked prefill with cache
hits on prefill; pools return to full on both sides; incompatible pairs are refused."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.disagg import local_pair
from pdserve.disagg.local_pair import build_side
from pdserve.disagg.manager import LinkConfig
from pdserve.disagg.rooms import Deadlines
from pdserve.requests import RequestBuilder
from pdserve.sampling_params import SamplingParams
from pdserve.disagg.decode_side import decode_scheduler
from pdserve.disagg.handoff import Phase
from pdserve.disagg.prefill_side import prefill_scheduler
from pdserve.scheduler.req import samples_from_message
from pdserve.testing import build_random_draft, build_random_model
from tests.scheduler.test_round_faults import inject_round_fault
from tests.waiting import wait_until

GREEDY = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}


def build_pd_models(root: Path) -> dict[str, Path]:
    """The target model and its EAGLE and EAGLE3 drafts these tests pair."""
    t = build_random_model(root / "t", "llama", num_layers=4, num_heads=4, num_kv_heads=2)
    return {"target": t, "EAGLE": build_random_draft(t, root / "e", "EAGLE"),
            "EAGLE3": build_random_draft(t, root / "e3", "EAGLE3", draft_vocab_size=50)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return build_pd_models(tmp_path_factory.mktemp("pd"))


SPEC: dict[str, dict[str, Any]] = {}


def sched(cls, dirs, algo: str | None, extra: dict[str, Any] | None = None, **kw):
    spec = {} if algo is None else dict(speculative_algorithm=algo, speculative_draft_model_path=str(dirs[algo]),
                                        speculative_num_steps=3, speculative_eagle_topk=2,
                                        speculative_num_draft_tokens=5)
    if algo is not None:
        SPEC[algo] = spec
    return build_side(cls, dirs["target"], {"max_total_tokens": 8192, **spec, **(extra or {})}, **kw)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(6, 90) for _ in range(40)]
    return [base[: rng.randrange(10, 40)] + [rng.randrange(6, 90) for _ in range(rng.randrange(3, 30))]
            for _ in range(n)]


def run_pair_outcomes(p, d, ps: list[list[int]], sampling: dict[str, Any] = GREEDY) -> list[Any]:
    """Every prompt through the pair: the decode side's samples once all ended."""
    return local_pair.run_pair(p, d, ps, sampling)


def run_pair(p, d, ps: list[list[int]], sampling: dict[str, Any] = GREEDY) -> list[list[int]]:
    reqs = run_pair_outcomes(p, d, ps, sampling)
    for r in reqs:
        assert r.finish.kind.value != "abort", r.finish
    return [r.output_ids for r in reqs]


def step_until(s, cond, timeout: float = 30) -> None:
    wait_until(cond, timeout, step=0.005, between=s.step)


def handshake_outcome(s) -> str | None:
    """Add a request to decode side ``s``; the handshake runs in the background and a
    refused one fails the request with the reason (returned; None: connected)."""
    builder = RequestBuilder(None, 4096, 10**6, 4, 0)
    r = samples_from_message(builder.group([5, 6, 7], SamplingParams.from_dict(GREEDY), False, 0))[0]
    r.bootstrap_host, r.bootstrap_port, r.bootstrap_room = "127.0.0.1", 1, random.getrandbits(62)
    s.add(r)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished = s.step().finished
        if finished:
            assert finished == [r] and r.finish.kind.value == "abort" and r.finish.server_error
            return r.finish.message
        if s.mode.manager.connection("http://127.0.0.1:1")[0] == "ok":
            return None
        time.sleep(0.01)
    raise AssertionError("the handshake neither succeeded nor failed")


def pools_full(s) -> None:
    assert s.flush_cache()
    m = s.memory_state()
    assert m["kv_pages_free"] == m["kv_pages_total"] and m["req_slots_free"] == m["req_slots_total"], m


# Every prefill x decode speculative cell, with both page sizes among them.
PD_CELLS = pytest.mark.parametrize("p_algo,d_algo,extra", [
    (None, None, {}),
    (None, None, {"page_size": 16}),
    ("EAGLE", "EAGLE", {}),
    ("EAGLE3", "EAGLE3", {"page_size": 16}),
    ("EAGLE", None, {}),
    (None, "EAGLE", {}),
    (None, "EAGLE3", {"page_size": 16}),
    ("EAGLE3", None, {"page_size": 16}),
], ids=["plain", "plain-page16", "eagle", "eagle3-page16", "eagle-to-plain", "plain-to-eagle", "plain-to-eagle3",
        "eagle3-to-plain"])


@PD_CELLS
def test_pd_pair_equals_colocated(make_engine, dirs, p_algo, d_algo, extra):
    ps = prompts(6)
    ref = [r["output_ids"] for r in make_engine(dirs["target"]).generate(input_ids=ps, sampling_params=GREEDY)]
    fetch: dict[str, Any] = {}
    # When both sides run the draft, prefill drafts each prompt chunk by chunk, in batches
    # that depend on when rooms bootstrap: unchunked here, so that its draft state is the
    # colocated one bit for bit (chunked: tests/disagg/test_pd_tp_speculative.py).
    shares = d_algo is not None and p_algo == d_algo
    p = sched(prefill_scheduler, dirs, p_algo, {**extra, "chunked_prefill_size": -1 if shares else 16})
    d = sched(decode_scheduler, dirs, d_algo, extra, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        assert run_pair(p, d, ps) == ref
        rounds = (d.spec.num_verify_rounds, d.spec.num_emitted_tokens) if d_algo else None
        # Again: prefill now serves every prompt from its radix cache and still sends all of it.
        assert run_pair(p, d, ps) == ref
        pools_full(p)
        pools_full(d)
        if d_algo:
            # The draft state decode starts from is the colocated one: the same rounds, the
            # same acceptance (the first seed's regression): rebuilt here from transferred
            # features, or drafted on prefill and handed over (its draft KV and state).
            colo = make_engine(dirs["target"], **SPEC[d_algo])
            colo.generate(input_ids=ps, sampling_params=GREEDY)
            cs = colo._scheduler.spec
            # (The first run: in the second, decode reuses its cached prefixes' draft KV where
            # colocated recomputes it over a cache hit.)
            assert rounds == (cs.num_verify_rounds, cs.num_emitted_tokens)
            # What crossed: the draft KV and state when both sides run the draft, else the
            # target features, and then decode ran its draft over every prompt itself.
            sent, received = p.mode.manager.bytes_by_kind, d.mode.bytes_by_kind
            assert sent == received and sent["target_kv"] > 0 and sent["metadata"] > 0, (sent, received)
            assert (sent["draft_kv"] > 0, sent["features"] > 0) == (shares, not shares), sent
            assert (d.mode.draft_prefill_tokens == 0) == shares, d.mode.draft_prefill_tokens
    finally:
        p.close()
        d.close()
        del fetch


@pytest.mark.parametrize("change", ["head", "topk"])
def test_a_different_draft_falls_back_to_features(make_engine, dirs, tmp_path, change):
    """Prefill and decode both run EAGLE, but not the same head (another checkpoint) or not
    the same top-k: the handshake tells them apart and decode drafts from features, as
    from a plain prefill; outputs equal colocated."""
    ps = prompts(4, seed=7)
    ref = [r["output_ids"] for r in make_engine(dirs["target"]).generate(input_ids=ps, sampling_params=GREEDY)]
    other = {"head": {"EAGLE": build_random_draft(dirs["target"], tmp_path / "e2", "EAGLE", seed=9)}, "topk": {}}
    p = sched(prefill_scheduler, {**dirs, **other[change]}, "EAGLE", {"chunked_prefill_size": 16})
    d = sched(decode_scheduler, dirs, "EAGLE", {"speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
              if change == "topk" else {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        assert (p.spec.identity == d.spec.identity) == (change == "topk")
        assert run_pair(p, d, ps) == ref
        sent = p.mode.manager.bytes_by_kind
        assert sent["features"] > 0 and sent["draft_kv"] == 0, sent
        assert d.mode.draft_prefill_tokens == sum(map(len, ps))
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_a_draft_state_of_another_shape_is_refused(dirs):
    """The draft state decode starts from must be its draft's: top-k and hidden width are
    checked on arrival (the second seed's width bug cannot pass silently)."""
    import torch

    from pdserve.disagg.handoff import carried_state, draft_state_message
    from pdserve.speculative.eagle_worker import CarriedState

    d = sched(decode_scheduler, dirs, "EAGLE3", {}, fetch_ranks=lambda url: [])
    try:
        req = samples_from_message(RequestBuilder(None, 4096, 10**6, 4, 0).group(
            [5, 6, 7], SamplingParams.from_dict(GREEDY), False, 0))[0]
        d.kv.reserve(req, 3, None)
        width = d.spec.config.hidden_size
        good = CarriedState(torch.tensor([0.5, 0.25]), torch.tensor([7, 9]), torch.arange(width, dtype=torch.float32))
        state = carried_state(draft_state_message(good))
        assert torch.equal(state.hidden, good.hidden) and state.topk_index.tolist() == [7, 9]
        d.spec.restore(req, state)
        assert req.draft_len == req.kv_len == 3 and torch.equal(d.spec.carried(req).hidden, good.hidden)
        for bad in (CarriedState(good.topk_p, good.topk_index, torch.zeros(3 * width)),
                    CarriedState(torch.tensor([1.0]), torch.tensor([7]), good.hidden)):
            with pytest.raises(ValueError, match=f"this draft reads top-2 and hidden {width}"):
                d.spec.restore(req, carried_state(draft_state_message(bad)))
        d.kv.release(req, cache_kv=False)
    finally:
        d.close()


@pytest.mark.parametrize("d_algo", [None, "EAGLE"])
def test_parallel_samples_cross_in_their_own_rooms(make_engine, dirs, d_algo):
    """n > 1: every sample is handed off in its own room and draws exactly what the
    colocated server's fork of that sample draws (seeded sampling, not just greedy)."""
    ps = prompts(3, seed=4)
    sampling = {"n": 3, "temperature": 1.0, "top_p": 0.9, "seed": 11, "max_new_tokens": 12, "ignore_eos": True}
    ref = [r["output_ids"] for r in make_engine(dirs["target"]).generate(input_ids=ps, sampling_params=sampling)]
    p = sched(prefill_scheduler, dirs, None, {"chunked_prefill_size": 16})
    d = sched(decode_scheduler, dirs, d_algo, {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        out = run_pair(p, d, ps, sampling)
        assert out == ref
        assert len({tuple(o) for o in out}) > len(ps)  # the samples really differ
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_incompatible_pairs_are_refused(dirs):
    p = sched(prefill_scheduler, dirs, None, {"page_size": 16})
    d = sched(decode_scheduler, dirs, None, {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    d3 = sched(decode_scheduler, dirs, "EAGLE3", {"page_size": 16},
               fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    de16 = sched(decode_scheduler, dirs, "EAGLE", {"page_size": 16},
                 fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    pe = sched(prefill_scheduler, dirs, "EAGLE", {})
    de3 = sched(decode_scheduler, dirs, "EAGLE3", {}, fetch_ranks=lambda url: [pe.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        assert "page_size: 16 vs 1" in handshake_outcome(d)
        # A plain prefill captures features for the first speculative decode that asks;
        # a second one whose draft reads other layers is refused, naming both.
        assert handshake_outcome(d3) is None
        assert re.search(r"already captures target features \[1, 2, 3\].*final", handshake_outcome(de16))
        assert "speculative_algorithm: EAGLE vs EAGLE3" in handshake_outcome(de3)
    finally:
        for s in (p, d, d3, de16, pe, de3):
            s.close()


def test_a_feature_pool_that_does_not_fit_is_refused_at_the_handshake(dirs, monkeypatch):
    """A plain prefill server makes its feature pool when the first speculative decode
    server connects, outside its startup budget: on a device without room for it the
    handshake is refused naming the fix, and the pool is not made."""
    from pdserve.disagg import prefill_features as prefill_module

    monkeypatch.setattr(prefill_module, "device_free_bytes", lambda device: 2 << 30)  # 2 GiB "free"
    p = sched(prefill_scheduler, dirs, None, {})
    monkeypatch.setattr(p.kv, "num_slots", 10**8)  # features for 10^8 slots: far more than 2 GiB
    d = sched(decode_scheduler, dirs, "EAGLE3", {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    builder = RequestBuilder(None, 4096, 10**6, 4, 0)
    try:
        r = samples_from_message(builder.group([5, 6, 7], SamplingParams.from_dict(GREEDY), False, 0))[0]
        r.bootstrap_host, r.bootstrap_port, r.bootstrap_room = "127.0.0.1", 1, random.getrandbits(62)
        d.add(r)
        deadline = time.monotonic() + 30
        while not r.finished and time.monotonic() < deadline:
            d.step()
            time.sleep(0.01)
        assert r.finished and r.finish.server_error, r.finish
        assert re.search(r"needs target features, \d+\.\d+ GiB.*only 2\.00 GiB.*--speculative-algorithm",
                         r.finish.message), r.finish.message
        assert p.feature_sink is None
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("p_algo,d_algo", [(None, None), (None, "EAGLE3"), ("EAGLE3", "EAGLE3")])
def test_pd_pair_on_qwen3(make_engine, tmp_path, p_algo, d_algo):
    t = build_random_model(tmp_path / "q", "qwen3", num_layers=4, num_heads=4, num_kv_heads=2)
    qdirs = {"target": t, "EAGLE3": build_random_draft(t, tmp_path / "q3", "EAGLE3", draft_vocab_size=40)}
    ps = prompts(4, seed=5)
    ref = [r["output_ids"] for r in make_engine(t).generate(input_ids=ps, sampling_params=GREEDY)]
    p = sched(prefill_scheduler, qdirs, p_algo, {"chunked_prefill_size": 16, "page_size": 16})
    d = sched(decode_scheduler, qdirs, d_algo, {"page_size": 16},
              fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        assert run_pair(p, d, ps) == ref
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_client_abort_on_decode_quarantines_pages_until_prefill_acknowledges(dirs):
    p = sched(prefill_scheduler, dirs, None, {})
    d = sched(decode_scheduler, dirs, None, {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    builder = RequestBuilder(None, 4096, 10**6, 4, 0)
    try:
        r = samples_from_message(builder.group(list(range(6, 40)), SamplingParams.from_dict(GREEDY), False, 0,
                                                rid="x"))[0]
        r.bootstrap_host, r.bootstrap_port, r.bootstrap_room = "127.0.0.1", 1, 99
        d.add(r)
        step_until(d, lambda: d.mode.handoffs.count(Phase.RECEIVING))  # connected in the background, then admitted
        assert d.mode.manager.rooms.get(99).state.name == "WAITING_FOR_INPUT"
        wait_until(lambda: p.mode.manager.rooms.get(99) is not None, 5, step=0.01)  # decode's request reached prefill
        (done,) = d.abort("x")
        assert done.finish.message == "aborted by the client"
        assert d.mode.handoffs.count(Phase.QUARANTINED), "pages reused before prefill confirmed no write is in flight"
        free_before = d.kv.allocator.num_free
        wait_until(lambda: p.mode.manager.status(99)[0].name == "FAILED", 5, step=0.01)  # prefill was told
        assert p.mode.manager.status(99)[1] == "aborted by decode: aborted by the client"
        wait_until(lambda: not d.mode.handoffs.count(Phase.QUARANTINED), 5, step=0.01, between=lambda: (p.step(), d.step()))
        assert not d.mode.handoffs.count(Phase.QUARANTINED) and d.kv.allocator.num_free > free_before
        p.step()
        assert p.mode.manager.rooms.get(99) is None  # prefill forgot the room
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_decode_retraction_finishes_without_new_traffic(make_engine, dirs):
    """A decode server whose pool cannot hold its admitted requests' outputs retracts some
    of them (they recompute their KV later); once the running batch drains, the retracted
    requests must still run to the end without any new request arriving, with the
    colocated greedy tokens, and both pools end full."""
    ps = prompts(8, seed=7)
    sampling = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    ref = [r["output_ids"] for r in make_engine(dirs["target"]).generate(input_ids=ps, sampling_params=sampling)]
    p = sched(prefill_scheduler, dirs, None, {"chunked_prefill_size": 16})
    d = sched(decode_scheduler, dirs, None, {"max_total_tokens": 320},
              fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        assert run_pair(p, d, ps, sampling) == ref
        assert d.state()["num_retractions"] > 0
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("phase", ["decode-admit", "prefill-send", "decode-commit", "prefill-readiness"])
def test_a_fault_with_one_request_fails_that_request_only(make_engine, dirs, phase, monkeypatch):
    """An error while admitting, transferring or committing one request ends that request
    with an internal error (a server error, so the router may retry it); the others are
    served correctly, nothing is leaked and both schedulers go on."""
    ps = prompts(4, seed=9)
    ref = [r["output_ids"] for r in make_engine(dirs["target"]).generate(input_ids=ps, sampling_params=GREEDY)]
    # A request decode failed to admit never asks prefill for its KV: prefill's room ends
    # at its bootstrap deadline, shortened here from 30 s.
    link = {"link": LinkConfig(deadlines=Deadlines(bootstrapping=3.0))} if phase == "decode-admit" else {}
    p = sched(prefill_scheduler, dirs, None, {"chunked_prefill_size": 16}, **link)
    d = sched(decode_scheduler, dirs, None, {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    rooms: list[int] = []
    real_add = d.add

    def add(req):  # learn the rooms the requests get
        rooms.append(req.bootstrap_room)
        return real_add(req)
    monkeypatch.setattr(d, "add", add)
    def failing(obj, name: str, room_of) -> None:
        """obj.name raises for the second request's room only."""
        real = getattr(obj, name)

        def broken(x, *args, **kwargs):
            if room_of(x) == rooms[1]:
                raise RuntimeError("injected fault")
            return real(x, *args, **kwargs)
        monkeypatch.setattr(obj, name, broken)
    try:
        if phase == "decode-admit":
            failing(d.mode.manager, "add_room", lambda room: room)
        elif phase == "prefill-send":
            failing(p.mode.manager, "send", lambda room: room)
        elif phase == "decode-commit":
            failing(d, "settle", lambda gain: gain.req.bootstrap_room)
        else:
            failing(p.mode, "_readiness", lambda h: h.room)
        reqs = run_pair_outcomes(p, d, ps)
        for i, r in enumerate(reqs):
            if i == 1:
                assert r.finish.kind.value == "abort" and r.finish.server_error, r.finish
                if phase != "prefill-send" and phase != "prefill-readiness":
                    assert "internal error" in r.finish.message and "injected fault" in r.finish.message
            else:
                assert r.finish.kind.value != "abort" and r.output_ids == ref[i], r.finish
        monkeypatch.undo()
        # Both go on: the same prompts again, all served.
        assert run_pair(p, d, ps) == ref
        wait_until(lambda: not d.has_work, 10, step=0.01, between=lambda: (p.step(), d.step()))
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_max_new_tokens_zero_ends_on_both_sides_like_colocated(make_engine, dirs):
    """Nothing to generate: each side ends the request on arrival with `length` and no
    token, as the colocated server does; no room is opened, nothing waits for a deadline."""
    ps = prompts(2, seed=3)
    sampling = {"max_new_tokens": 0, "n": 2, "temperature": 0}
    colo = make_engine(dirs["target"]).generate(input_ids=ps, sampling_params=sampling)
    assert all(r["output_ids"] == [] and r["meta_info"]["finish_reason"]["type"] == "length" for r in colo)
    p = sched(prefill_scheduler, dirs, None, {})
    d = sched(decode_scheduler, dirs, None, {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        reqs = run_pair_outcomes(p, d, ps, sampling)
        assert len(reqs) == 4 and all(r.output_ids == [] and r.finish.kind.value == "length" for r in reqs)
        assert not p.mode.manager.rooms.counts().get("bootstrapping") and not d.mode.manager.rooms.counts().get("bootstrapping")
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("where", ["draft", "forward", "process"])
@pytest.mark.parametrize("d_algo", ["EAGLE", "EAGLE3"])
def test_a_fault_in_a_decode_servers_round_fails_its_requests_and_leaks_nothing(make_engine, dirs, d_algo, where,
                                                                              monkeypatch):
    """A decode server's speculative round fails in its draft forwards, its target
    forward or its process step: the requests in that round end with the error, the
    round's pages (16 per page here: opened past each request's length) come back, and
    the pair goes on serving."""
    ps = prompts(3, seed=5)
    ref = [r["output_ids"] for r in make_engine(dirs["target"]).generate(input_ids=ps, sampling_params=GREEDY)]
    p = sched(prefill_scheduler, dirs, None, {"page_size": 16})
    d = sched(decode_scheduler, dirs, d_algo, {"page_size": 16},
              fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    # A decode server's only target forwards are its rounds (its prompts' KV arrives).
    fired = inject_round_fault(monkeypatch, d, where, forwards_before=0)
    try:
        reqs = run_pair_outcomes(p, d, ps)
        assert fired
        failed = [r for r in reqs if r.finish.kind.value == "abort"]
        assert failed, [r.finish for r in reqs]
        for i, r in enumerate(reqs):
            if r in failed:
                assert r.finish.server_error and "injected fault" in r.finish.message, r.finish
            else:
                assert r.output_ids == ref[i]
        monkeypatch.undo()
        assert run_pair(p, d, ps) == ref
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()
