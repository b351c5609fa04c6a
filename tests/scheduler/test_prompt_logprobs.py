"""Prompt logprobs (logprob_start_len) against a transformers full-prompt forward:
plain, chunked prefill, after a prefix-cache hit, with n > 1 and max_new_tokens 0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import GREEDY, random_prompts

pytestmark = pytest.mark.fast

PROMPTS = random_prompts(3, 20, 60, seed=5)
TOP = 3


@pytest.fixture(scope="module")
def hf_reference(llama_dir: Path) -> list[tuple[list[float], list[list[tuple[float, int]]]]]:
    """Per prompt: log_softmax(logits at i-1)[t_i] for i >= 1, and the top-TOP of the same rows."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            lps = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
            vals, idx = logp[:-1].topk(TOP, dim=-1)
            tops = [[(float(v), int(t)) for v, t in zip(vr, ir)] for vr, ir in zip(vals, idx)]
            out.append((lps, tops))
    return out


def check(result: dict, ids: list[int], start: int, ref: tuple[list[float], list[list[tuple[float, int]]]],
          top: bool = True) -> None:
    meta = result["meta_info"]
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(ids) - start
    assert [t for _, t, _ in entries] == ids[start:]
    ref_lps, ref_tops = ref
    got = [lp for lp, _, _ in entries]
    if start == 0:  # the first prompt token has no logprob
        assert got[0] is None
        got, want, want_tops = got[1:], ref_lps, ref_tops
        tops = meta["input_top_logprobs"][1:] if top else None
        if top:
            assert meta["input_top_logprobs"][0] is None
    else:
        want, want_tops = ref_lps[start - 1:], ref_tops[start - 1:]
        tops = meta["input_top_logprobs"] if top else None
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    if top:
        assert len(tops) == len(want_tops)
        for step, ref_step in zip(tops, want_tops):
            # Values, not ids: ties may order ids differently.
            assert max(abs(lp - r) for (lp, _, _), (r, _) in zip(step, ref_step)) < 1e-4


@pytest.mark.parametrize("chunk", [-1, 7])
def test_prompt_logprobs_match_transformers(chunk, hf_reference, make_engine, llama_dir):
    engine = make_engine(llama_dir, chunked_prefill_size=chunk)
    params = dict(GREEDY, max_new_tokens=4)
    for start in (0, 1, 13):
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True,
                               top_logprobs_num=TOP, logprob_start_len=start)
        for out, ids, ref in zip(outs, PROMPTS, hf_reference):
            check(out, ids, start, ref)
            assert len(out["meta_info"]["output_token_logprobs"]) == 4


def test_prefix_cache_hit_still_computes_the_asked_positions(hf_reference, make_engine, llama_dir):
    engine = make_engine(llama_dir, page_size=4, chunked_prefill_size=16)
    params = dict(GREEDY, max_new_tokens=3)
    ids = PROMPTS[1]
    plain = engine.generate(input_ids=ids, sampling_params=params)
    # The whole prompt is cached now; prompt logprobs from position 10 on must still be
    # computed (the cache serves at most the positions before 9).
    again = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True, top_logprobs_num=TOP,
                            logprob_start_len=10)
    assert 0 < again["meta_info"]["cached_tokens"] <= 9
    check(again, ids, 10, hf_reference[1])
    assert again["output_ids"] == plain["output_ids"]
    # Without prompt logprobs the cache serves the prompt as before.
    hit = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    assert hit["meta_info"]["cached_tokens"] > 9
    assert "input_token_logprobs" not in hit["meta_info"]


def test_n_samples_share_prompt_logprobs_and_max_new_tokens_zero(hf_reference, make_engine, llama_dir):
    engine = make_engine(llama_dir)
    ids = PROMPTS[2]
    outs = engine.generate(input_ids=ids, sampling_params=dict(max_new_tokens=3, n=3, temperature=1.0, seed=4),
                           return_logprob=True, top_logprobs_num=TOP, logprob_start_len=0)
    assert len(outs) == 3
    for out in outs:
        check(out, ids, 0, hf_reference[2])
    scored = engine.generate(input_ids=ids, sampling_params=dict(max_new_tokens=0, n=2), return_logprob=True,
                             logprob_start_len=0)
    for out in scored:
        assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
        check(out, ids, 0, hf_reference[2], top=False)
        assert "input_top_logprobs" not in out["meta_info"]


def test_logprob_start_len_is_checked(make_engine, llama_dir):
    engine = make_engine(llama_dir)
    ids = PROMPTS[0]
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.generate(input_ids=ids, return_logprob=True, logprob_start_len=len(ids))
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.generate(input_ids=ids, return_logprob=True, logprob_start_len=-2)
    # The last prompt position is valid: one entry.
    out = engine.generate(input_ids=ids, sampling_params=dict(GREEDY, max_new_tokens=1), return_logprob=True,
                          logprob_start_len=len(ids) - 1)
    assert len(out["meta_info"]["input_token_logprobs"]) == 1


def test_speculative_server_gives_the_same_prompt_logprobs(hf_reference, make_engine, llama_dir, tmp_path):
    # An EAGLE prefill also stores draft features for every position: the extra logits
    # rows must not disturb it (output tokens equal the plain engine's too).
    from pdserve.testing import build_random_draft

    draft = build_random_draft(llama_dir, tmp_path / "eagle", "EAGLE")
    plain = make_engine(llama_dir)
    spec = make_engine(llama_dir, speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft),
                       chunked_prefill_size=16)
    params = dict(GREEDY, max_new_tokens=6)
    want = plain.generate(input_ids=PROMPTS, sampling_params=params)
    got = spec.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True, top_logprobs_num=TOP,
                        logprob_start_len=2)
    for g, w, ids, ref in zip(got, want, PROMPTS, hf_reference):
        assert g["output_ids"] == w["output_ids"]
        check(g, ids, 2, ref)
