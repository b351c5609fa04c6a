"""EAGLE / EAGLE3 with --tp-size 2 (gloo, two scheduler processes): the draft is replicated
on each rank, every rank proposes the same tree and accepts the same path (checked each
round with --debug-tp-agreement), and the output equals single-rank plain decoding,
greedy and seeded sampling alike."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from tests.conftest import random_prompts
from tests.speculative.test_eagle_engine import drafts, target  # noqa: F401  (the module's fixtures)
from tests.server.conftest import free_port

GREEDY = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
PROMPTS = random_prompts(5, 4, 50, vocab=95, seed=41)


def spec(drafts: dict[str, Path], algo: str, shape: tuple[int, int, int]) -> dict:
    return dict(speculative_algorithm=algo, speculative_draft_model_path=str(drafts[algo]),
                speculative_num_steps=shape[0], speculative_eagle_topk=shape[1],
                speculative_num_draft_tokens=shape[2])


# (2, 1, 3) is the first seed's decode shape; (4, 2, 8) a tree.
@pytest.mark.parametrize("algo,shape,page_size", [("EAGLE", (2, 1, 3), 1), ("EAGLE3", (4, 2, 8), 16),
                                                  ("EAGLE", (4, 2, 8), 16), ("EAGLE3", (2, 1, 3), 1)],
                         ids=["eagle-chain", "eagle3-tree-page16", "eagle-tree-page16", "eagle3-chain"])
def test_tp2_speculative_equals_tp1_plain(make_engine, target, drafts, algo, shape, page_size):
    ref = [r["output_ids"] for r in make_engine(target).generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    engine = make_engine(target, tp_size=2, page_size=page_size, chunked_prefill_size=16, debug_tp_agreement=True,
                         **spec(drafts, algo, shape))
    got = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r["output_ids"] for r in got] == ref
    assert all(r["meta_info"]["spec_verify_ct"] >= 1 for r in got)
    # Again: every prompt now hits the radix cache (the draft state is rebuilt from features).
    again = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r["output_ids"] for r in again] == ref
    assert sum(r["meta_info"]["cached_tokens"] for r in again) > 0


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_tp2_demo_heads_accept_as_on_one_rank(make_engine, algo):
    """The demo model with its trained heads at the seed's chain shape: TP2 equals TP1
    plain and accepts drafts (the random heads above rarely do)."""
    from pdserve import assets
    from pdserve.assets import demo_tasks

    plain = make_engine(assets.path("demo"))
    tok = plain.tokenizer
    convs = [c for t in demo_tasks.TASKS for c in demo_tasks.heldout_conversations(t, 2, 2)]
    ps = [tok(tok.apply_chat_template(list(c.messages), add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"] for c in convs]
    params = {"max_new_tokens": 32, "temperature": 0}
    ref = plain.generate(input_ids=ps, sampling_params=params)
    head = str(assets.path("demo-eagle" if algo == "EAGLE" else "demo-eagle3"))
    got = make_engine(assets.path("demo"), tp_size=2, debug_tp_agreement=True, speculative_algorithm=algo,
                      speculative_draft_model_path=head, speculative_num_steps=2, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=3).generate(input_ids=ps, sampling_params=params)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in ref]
    rounds = sum(r["meta_info"].get("spec_verify_ct", 0) for r in got)
    accepted = sum(r["meta_info"].get("spec_accepted_drafts", 0) for r in got)
    assert 1 + accepted / rounds > 1.5, (accepted, rounds)


def test_tp2_speculative_sampling_equals_plain(make_engine, target, drafts):
    """Seeded sampling: the verify draw is plain decoding's draw at that position, so a
    TP2 speculative run reproduces the TP2 plain run token for token (n > 1 included)."""
    params = [{"temperature": 1.0, "top_p": 0.9, "seed": s, "max_new_tokens": 12, "ignore_eos": True, "n": 2}
              for s in range(len(PROMPTS))]
    plain = make_engine(target, tp_size=2).generate(input_ids=PROMPTS, sampling_params=params)
    fast = make_engine(target, tp_size=2, debug_tp_agreement=True, **spec(drafts, "EAGLE3", (3, 2, 5))).generate(
        input_ids=PROMPTS, sampling_params=params)
    assert [r["output_ids"] for r in fast] == [r["output_ids"] for r in plain]


def _agree_rank(rank: int, init_method: str, value: float, out: "mp.Queue[str]") -> None:
    from pdserve.model.parallel import TPDisagreement, assert_agree, init_tp_group

    tp = init_tp_group(rank, 2, init_method, torch.device("cpu"))
    try:
        assert_agree(tp, torch.tensor([[1, 2], [3, 4]]), "equal values")
        try:
            assert_agree(tp, torch.tensor([[1, 2], [3, 4 + value * rank]]), "the draft tree")
            out.put(f"{rank}: no error")
        except TPDisagreement as exc:
            out.put(f"{rank}: {exc}")
    finally:
        torch.distributed.destroy_process_group()


def test_disagreeing_ranks_are_caught_on_every_rank():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_agree_rank, args=(r, init, 1.0, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got = sorted(out.get(timeout=5) for _ in procs)
    assert got == ["0: TP ranks disagree on the draft tree: rank(s) [1] differ from rank 0 (this is rank 0)",
                   "1: TP ranks disagree on the draft tree: rank(s) [1] differ from rank 0 (this is rank 1)"]
