"""n > 1 across the split: the prefill server computes a request's prompt once (sample 0
carries the others, which are forked from it as colocated) and sends each sample's own
room the prompt KV and its own first token. In-process prefill + decode schedulers over
the in-process transfer engine (see test_pd_schedulers.py): seeded samples equal the
colocated server's, the prefill counts each prompt's tokens once, a failed room ends
only its sample (also the one computing the prompt: another takes over), and both pools
return to full."""

from __future__ import annotations

import random
import time
from typing import Any, Callable

import pytest
import torch

from pdserve.disagg import local_pair
from pdserve.requests import RequestBuilder
from pdserve.sampling_params import SamplingParams
from pdserve.disagg.decode_side import decode_scheduler
from pdserve.disagg.handoff import Phase
from pdserve.disagg.prefill_side import prefill_scheduler
from pdserve.scheduler.req import Req, samples_from_message
from tests.disagg.test_pd_schedulers import SPEC, dirs, pools_full, prompts, sched  # noqa: F401 (fixture)

SAMPLED = {"n": 4, "temperature": 1.0, "top_p": 0.9, "seed": 11, "max_new_tokens": 10, "ignore_eos": True}


def long_prompt(n: int = 75, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 90) for _ in range(n)]


def drive(p, d, ps: list[list[int]], sampling: dict[str, Any], logprob_start_len: int = -1,
          hook: Callable[[], None] | None = None) -> tuple[list[Req], dict[tuple[str, int], Req]]:
    """Send every prompt through the pair (one room per sample); ``hook`` runs after each
    prefill step. Returns decode's samples in prompt order once all ended (each exactly
    once) and prefill holds nothing more, and prefill's ended samples by (rid, sample)."""
    p_done: dict[tuple[str, int], Req] = {}
    out = local_pair.run_pair(p, d, ps, sampling, logprob_start_len=logprob_start_len, between=hook,
                              prefill_done=p_done)
    assert len(p_done) == len(out), "prefill did not report every sample"
    return out, p_done


def computed_once(p, ps: list[list[int]], n: int) -> int:
    """Prompt tokens a prefill computing each prompt once computes: each prompt's tokens
    less the cached ones (``cached_tokens_seen`` counts them once per sample)."""
    assert p.planner.cached_tokens_seen % n == 0
    return sum(len(x) for x in ps) - p.planner.cached_tokens_seen // n


@pytest.mark.parametrize("d_algo,page_size", [(None, 1), (None, 16), ("EAGLE", 1), ("EAGLE", 16)],
                         ids=["plain", "plain-page16", "eagle-decode", "eagle-decode-page16"])
def test_samples_equal_colocated_and_prompt_is_computed_once(make_engine, dirs, d_algo, page_size):
    ps = prompts(3, seed=4) + [long_prompt()]  # the long one is prefilled in 5 chunks
    colo = make_engine(dirs["target"], page_size=page_size)
    ref = [r["output_ids"] for r in colo.generate(input_ids=ps, sampling_params=SAMPLED)]
    p = sched(prefill_scheduler, dirs, None, {"chunked_prefill_size": 16, "page_size": page_size})
    d = sched(decode_scheduler, dirs, d_algo, {"page_size": page_size},
              fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    sent: dict[int, dict[int, torch.Tensor]] = {}  # room -> position -> the feature row sent
    real_send = p.mode.manager.send

    def send(room: int, slots, first: int, ready=None, draft: bool = False) -> None:
        assert p.feature_sink is not None and not draft  # (a plain prefill has no draft)
        for i, row in enumerate(p.feature_sink[1][torch.tensor(slots)]):
            sent.setdefault(room, {})[first + i] = row.clone()
        real_send(room, slots, first, ready, draft)
    if d_algo:
        p.mode.manager.send = send  # type: ignore[method-assign]
    try:
        out, _ = drive(p, d, ps, SAMPLED)
        assert [r.output_ids for r in out] == ref
        assert len({tuple(r.output_ids) for r in out}) > len(ps)  # the samples really differ
        if d_algo:
            # Every sample's room got the prompt's target features, its copied partial
            # last page included (decode's draft reads them) ...
            for i, ids in enumerate(ps):
                rows = [torch.stack([sent[r.bootstrap_room][j] for j in range(len(ids))])
                        for r in out if r.rid == f"r{i}"]
                assert all(x.abs().sum(dim=1).gt(0).all() for x in rows)
                assert all(torch.equal(rows[0], x) for x in rows[1:])
            # ... and every sample's draft state is the colocated one (the same rounds).
            spec = make_engine(dirs["target"], page_size=page_size, **SPEC[d_algo])
            colo_spec = spec.generate(input_ids=ps, sampling_params=SAMPLED)
            rounds = [r["meta_info"].get("spec_verify_ct") for r in colo_spec]
            assert [r.spec_verify_ct for r in out] == rounds
        computed = p.state()["prefill_tokens_computed"]
        assert computed == computed_once(p, ps, 4) and computed <= sum(len(x) for x in ps)
        assert p.planner.cached_tokens_seen < 4 * sum(len(x) for x in ps)  # (not all of it cached)
        # Again: prefill serves every prompt from its radix cache, computing only each
        # prompt's last (partial) page, once per request; decode still gets every sample.
        out, _ = drive(p, d, ps, SAMPLED)
        assert [r.output_ids for r in out] == ref
        assert p.state()["prefill_tokens_computed"] == computed_once(p, ps + ps, 4)
        assert p.state()["prefill_tokens_computed"] - computed <= len(ps) * page_size
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_one_long_prompt_n4_is_computed_once(make_engine, dirs):
    ps = [long_prompt(90, seed=3)]
    sampling = {**SAMPLED, "max_new_tokens": 4}
    ref = [r["output_ids"] for r in make_engine(dirs["target"]).generate(input_ids=ps, sampling_params=sampling)]
    p = sched(prefill_scheduler, dirs, None, {"chunked_prefill_size": 16})
    d = sched(decode_scheduler, dirs, None, {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        out, _ = drive(p, d, ps, sampling)
        assert [r.output_ids for r in out] == ref
        assert p.state()["prefill_tokens_computed"] == 90  # was 4 x 90: each sample prefilled on its own
        assert [r.cached_tokens for r in out] == [0] * 4
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("victim", [0, 2], ids=["carrier", "sibling"])
def test_a_failed_room_mid_prefill_ends_only_its_sample(make_engine, dirs, victim):
    """One sample's room fails while the shared prompt is half computed: that sample ends
    (decode hears of it), the others get exactly the colocated output. When the failed
    one is sample 0, which computes the prompt, the next sample takes the computation
    over. Nothing leaks on either side."""
    ps = [long_prompt(80, seed=5)]
    sampling = {**SAMPLED, "n": 3}
    ref = [r["output_ids"] for r in make_engine(dirs["target"]).generate(input_ids=ps, sampling_params=sampling)]
    p = sched(prefill_scheduler, dirs, None, {"chunked_prefill_size": 16})
    d = sched(decode_scheduler, dirs, None, {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    failed: list[int] = []

    def fail_mid_way() -> None:
        c = p.chunked
        if not failed and c is not None and 16 < c.kv_len < c.fill_len:
            assert c.sample_index == 0 and len(c.pending_forks) == 2
            room = ([c] + c.pending_forks)[victim].bootstrap_room
            assert p.mode.handoffs.get(room).phase is (Phase.COMPUTING if victim == 0 else Phase.AWAITING_PROMPT)
            p.mode.manager.abort(room, "injected failure")
            failed.append(room)
    try:
        out, p_out = drive(p, d, ps, sampling, hook=fail_mid_way)
        assert failed, "the prompt was never seen half computed"
        for i, r in enumerate(out):
            if i == victim:
                assert r.finish.kind.value == "abort" and "injected failure" in r.finish.message, r.finish
                assert p_out[("r0", i)].finish.kind.value == "abort"
            else:
                assert r.finish.kind.value != "abort" and r.output_ids == ref[i], r.finish
        if victim != 0:  # computed once, by sample 0
            assert p.state()["prefill_tokens_computed"] == 80
        wait_drained(p, d)
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_client_abort_of_a_waiting_request_ends_every_sample_once(dirs):
    """An abort while sample 0 computes the prompt and the others wait for it ends each
    sample exactly once, on both sides; nothing leaks."""
    p = sched(prefill_scheduler, dirs, None, {"chunked_prefill_size": 16})
    d = sched(decode_scheduler, dirs, None, {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    builder = RequestBuilder(None, 4096, 10**6, 4, 0)
    try:
        msg = builder.group(long_prompt(80), SamplingParams.from_dict({**SAMPLED, "n": 3}), False, 0, rid="x")
        gp, gd = samples_from_message(msg), samples_from_message(msg)
        local_pair.give_rooms(gp, gd)
        p.add(gp[0])
        d.add(gd[0])
        deadline = time.monotonic() + 30
        while not (p.chunked is not None and p.chunked.kv_len > 16) and time.monotonic() < deadline:
            p.step()
            d.step()
            time.sleep(0.001)
        assert p.chunked is gp[0]
        ended = p.abort("x")
        assert sorted(r.sample_index for r in ended) == [0, 1, 2]
        assert all(r.finish.kind.value == "abort" for r in ended) and not p.mode.handoffs
        wait_drained(p, d, until=lambda: all(r.finish is not None for r in gd))
        assert all(r.finish.kind.value == "abort" for r in gd)
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_prompt_logprobs_are_computed_once_and_shared(make_engine, dirs):
    """Prompt logprobs (echo) of an n > 1 request: computed by the one prefill of the
    prompt, every sample reports them, equal to the colocated server's."""
    ps = [long_prompt(40, seed=8)]
    sampling = {**SAMPLED, "n": 3, "max_new_tokens": 3}
    colo = make_engine(dirs["target"]).generate(input_ids=ps, sampling_params=sampling, return_logprob=True,
                                                logprob_start_len=0)
    want = [[e[0] for e in r["meta_info"]["input_token_logprobs"]] for r in colo]
    p = sched(prefill_scheduler, dirs, None, {"chunked_prefill_size": 16})
    d = sched(decode_scheduler, dirs, None, {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        out, p_out = drive(p, d, ps, sampling, logprob_start_len=0)
        assert [r.output_ids for r in out] == [r["output_ids"] for r in colo]
        got = [p_out[("r0", j)].input_logprobs for j in range(3)]
        assert got == want and len(got[0]) == 40
        assert p.state()["prefill_tokens_computed"] == 40
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def wait_drained(p, d, until: Callable[[], bool] = lambda: True, timeout: float = 10) -> None:
    """Step both until decode holds nothing (quarantined pages back) and ``until``."""
    deadline = time.monotonic() + timeout
    while (d.has_work or p.has_work or not until()) and time.monotonic() < deadline:
        p.step()
        d.step()
        time.sleep(0.005)
    assert not d.has_work and not p.has_work and until()
