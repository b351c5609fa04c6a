"""Named regressions for the two SGLang bugs this project started from, on the embedded
demo model and its trained heads, through a real prefill/decode pair (in one process).

Seed 1 (decode-only draft layers shifted decode's V caches; accuracy 0.92 -> 0.011):
prefill without speculation, decode with EAGLE: outputs equal colocated, demo accuracy
unchanged. Seed 2 (EAGLE3 hidden states / top-k across the split): prefill and decode
with EAGLE3: no width error, and the first round's acceptance equals colocated."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve import assets
from pdserve.assets import demo_tasks
from pdserve.tokenizer import load_tokenizer
from tests.disagg.test_pd_schedulers import decode_scheduler, prefill_scheduler, pools_full, run_pair, sched

N_PER_TASK = 8


@pytest.fixture(scope="module")
def dirs() -> dict[str, Any]:
    return {"target": assets.path("demo"), "EAGLE": assets.path("demo-eagle"), "EAGLE3": assets.path("demo-eagle3")}


@pytest.fixture(scope="module")
def questions():
    tok = load_tokenizer(assets.path("demo"))
    convs = [c for t in (*demo_tasks.TASKS, "multi-turn") for c in demo_tasks.heldout_conversations(t, N_PER_TASK, 1)]
    ids = [tok(tok.apply_chat_template(list(c.messages), add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for c in convs]
    return tok, convs, ids


def accuracy(tok, convs, outputs) -> float:
    return sum(tok.decode(o, skip_special_tokens=True).strip() == c.answer for c, o in zip(convs, outputs)) / len(convs)


PARAMS = {"max_new_tokens": 40, "temperature": 0}


def test_seed1_plain_prefill_eagle_decode_keeps_outputs_and_accuracy(make_engine, dirs, questions):
    tok, convs, ids = questions
    colocated = make_engine(dirs["target"]).generate(input_ids=ids, sampling_params=PARAMS)
    ref = [r["output_ids"] for r in colocated]
    p = sched(prefill_scheduler, dirs, None, {"chunked_prefill_size": 64})
    d = sched(decode_scheduler, dirs, "EAGLE", {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        got = run_pair(p, d, ids, PARAMS)
        assert got == ref
        assert accuracy(tok, convs, got) == accuracy(tok, convs, ref)
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_seed2_eagle3_across_the_split_first_round_acceptance(make_engine, dirs, questions):
    """The draft state decode starts from (top-k ids and probabilities, draft hidden) equals
    the colocated server's after its prefill, so the first round drafts the same tokens;
    overall acceptance matches within float noise (batching differs between the setups).
    Both sides run the same head: prefill drafts the prompt and hands the state over (the
    card's hand-off), and decode runs no draft over the prompt."""
    import torch

    tok, convs, ids = questions
    shape = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)  # = sched()'s
    colo = make_engine(dirs["target"], speculative_algorithm="EAGLE3",
                       speculative_draft_model_path=str(dirs["EAGLE3"]), **shape)
    first: dict[tuple[int, ...], Any] = {}

    def recording(worker):
        orig = worker.catch_up

        def catch_up(reqs):
            orig(reqs)
            for r in reqs:
                if r.row is not None:
                    first.setdefault((id(worker), tuple(r.prompt_ids)), worker.carried(r))
        worker.catch_up = catch_up
    recording(colo._scheduler.spec)
    colocated = colo.generate(input_ids=ids, sampling_params=PARAMS)
    p = sched(prefill_scheduler, dirs, "EAGLE3", {})
    d = sched(decode_scheduler, dirs, "EAGLE3", {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    restore = d.spec.restore

    def restoring(req, state):  # what decode starts each request from
        restore(req, state)
        first.setdefault((id(d.spec), tuple(req.prompt_ids)), d.spec.carried(req))
    d.spec.restore = restoring
    try:
        got = run_pair(p, d, ids, PARAMS)
        assert got == [r["output_ids"] for r in colocated]
        assert d.mode.draft_prefill_tokens == 0 and p.mode.manager.bytes_by_kind["features"] == 0
        for prompt in ids:
            a = first[(id(colo._scheduler.spec), tuple(prompt))]
            b = first[(id(d.spec), tuple(prompt))]
            assert a.topk_index.tolist() == b.topk_index.tolist()
            torch.testing.assert_close(a.topk_p, b.topk_p, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(a.hidden, b.hidden, atol=1e-4, rtol=1e-4)
        assert abs(d.spec.avg_accept_length / colo._scheduler.spec.avg_accept_length - 1) < 0.1
        assert d.spec.avg_accept_length > 1.3  # the trained head does accept drafts
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("p_algo,d_algo", [(None, None), ("EAGLE", "EAGLE"), ("EAGLE", None), (None, "EAGLE3"),
                                           ("EAGLE3", None), ("EAGLE3", "EAGLE3")],
                         ids=["plain", "eagle", "eagle-to-plain", "plain-to-eagle3", "eagle3-to-plain", "eagle3"])
def test_demo_model_configuration_matrix(make_engine, dirs, questions, p_algo, d_algo):
    """The compatible cells of {P plain, EAGLE, EAGLE3} x {D plain, EAGLE, EAGLE3} on the demo
    model and its trained heads (seed1 is the plain -> EAGLE cell; EAGLE x EAGLE3 is refused at
    handshake, tested with random heads), page size 16 and chunked prefill on prefill."""
    tok, convs, ids = questions
    ids = ids[::4]
    ref = [r["output_ids"] for r in make_engine(dirs["target"]).generate(input_ids=ids, sampling_params=PARAMS)]
    p = sched(prefill_scheduler, dirs, p_algo, {"chunked_prefill_size": 32, "page_size": 16})
    d = sched(decode_scheduler, dirs, d_algo, {"page_size": 16},
              fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        assert run_pair(p, d, ids, PARAMS) == ref
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()
