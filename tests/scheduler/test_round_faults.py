"""Faults inside a speculative round and in admission end only the requests they hit,
and give back everything those held: the round's pages past each request's length
included (they are opened and closed by the KV manager, and released by whatever ends
the request). Colocated here; a decode server's rounds in tests/disagg/test_pd_schedulers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.config import ServerArgs
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.scheduler import Scheduler
from pdserve.testing import build_random_draft
from tests.scheduler.test_step_faults import pools_full, requests, run

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def drafts(llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("round_faults")
    return {"EAGLE": build_random_draft(llama_dir, root / "e", "EAGLE", seed=1),
            "EAGLE3": build_random_draft(llama_dir, root / "e3", "EAGLE3", draft_vocab_size=60, seed=2)}


def eagle_sched(llama_dir: Path, draft: Path, algo: str, page_size: int) -> Scheduler:
    # Page size 4 with a 5-node tree: every round opens a page past each request's length.
    args = ServerArgs(model_path=str(llama_dir), max_total_tokens=2048, chunked_prefill_size=-1,
                      page_size=page_size, speculative_algorithm=algo, speculative_draft_model_path=str(draft),
                      speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    return Scheduler(args, ModelRunner(args, llama_dir, TPGroup()), lambda ids: "")


def inject_round_fault(monkeypatch, sched: Scheduler, where: str, forwards_before: int) -> list[int]:
    """The first speculative round fails at ``where``: its draft forwards (planning), its
    target forward (the one after ``forwards_before`` others: prefills), or its process
    step (drawing the tree's tokens). Returns a list that holds an entry once it fired."""
    fired: list[int] = []

    def failing_once(real, skip: int = 0):
        calls: list[int] = []

        def broken(*args, **kwargs):
            calls.append(1)
            if not fired and len(calls) > skip:
                fired.append(1)
                raise RuntimeError("injected fault")
            return real(*args, **kwargs)
        return broken
    if where == "draft":
        monkeypatch.setattr(sched.spec, "propose", failing_once(sched.spec.propose))
    elif where == "process":
        monkeypatch.setattr(sched.sampler, "draw_tree", failing_once(sched.sampler.draw_tree))
    else:
        monkeypatch.setattr(sched, "forward", failing_once(sched.forward, skip=forwards_before))
    return fired


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("where", ["draft", "forward", "process"])
@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_a_fault_in_a_round_fails_its_requests_and_leaks_nothing(llama_dir, drafts, monkeypatch, algo, where,
                                                                 page_size):
    sched = eagle_sched(llama_dir, drafts[algo], algo, page_size)
    for g in requests(2, max_new=12):
        sched.add(g[0])
    fired = inject_round_fault(monkeypatch, sched, where, forwards_before=1)  # (1: both prompts' prefill)
    done = run(sched)
    assert fired
    assert len(done) == 2
    for r in done.values():
        assert r.finish.kind.value == "abort" and r.finish.server_error, r.finish
        assert "internal error" in r.finish.message and "injected fault" in r.finish.message
    pools_full(sched)
    monkeypatch.undo()
    for g in requests(3, max_new=12):
        sched.add(g[0])
    assert all(r.finish.kind.value == "length" for r in run(sched).values())
    pools_full(sched)


@pytest.mark.parametrize("speculative", [False, True])
def test_a_fault_admitting_one_request_fails_that_request_only(llama_dir, drafts, monkeypatch, speculative):
    args = ServerArgs(model_path=str(llama_dir), max_total_tokens=2048, chunked_prefill_size=-1)
    sched = (eagle_sched(llama_dir, drafts["EAGLE"], "EAGLE", 1) if speculative else
             Scheduler(args, ModelRunner(args, llama_dir, TPGroup()), lambda ids: ""))
    groups = requests(3, max_new=6)
    victim = groups[1][0]
    real_match = sched.kv.match

    def match(ids):
        if list(ids) == victim.fill_ids[:len(ids)] and len(ids) >= len(victim.fill_ids) - 1:
            raise RuntimeError("injected fault")
        return real_match(ids)
    monkeypatch.setattr(sched.kv, "match", match)
    for g in groups:
        sched.add(g[0])
    done = run(sched)
    assert len(done) == 3
    assert done[(victim.rid, 0)].finish.server_error and "injected fault" in done[(victim.rid, 0)].finish.message
    for g in groups[::2]:
        assert done[(g[0].rid, 0)].finish.kind.value == "length", done[(g[0].rid, 0)].finish
    monkeypatch.undo()
    pools_full(sched)
