"""pdserve's model math against Hugging Face transformers on random checkpoints."""

from __future__ import annotations

import pytest

from tests.conftest import GREEDY, hf_greedy, random_prompts

pytestmark = pytest.mark.fast

NEW = 10


@pytest.mark.parametrize("name", ["llama_gqa", "llama_tied", "llama3_rope", "qwen2", "qwen3"])
def test_greedy_tokens_and_logprobs_match_transformers(name, model_dirs, make_engine):
    model_dir = model_dirs(name)
    prompts = random_prompts(5, 3, 90, seed=hash(name) % 1000)
    ref = hf_greedy(model_dir, prompts, NEW)
    engine = make_engine(model_dir)
    params = dict(GREEDY, max_new_tokens=NEW)
    together = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    engine.flush_cache()  # the one-by-one run must compute, not hit the cache
    one_by_one = [engine.generate(input_ids=p, sampling_params=params, return_logprob=True)
                  for p in prompts]
    for (ref_ids, ref_lps), a, b in zip(ref, together, one_by_one):
        for out in (a, b):
            assert out["output_ids"] == ref_ids
            lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert max(abs(x - y) for x, y in zip(lps, ref_lps)) < 1e-4


def test_mistral_architecture_loads(tmp_path, make_engine):
    from pdserve.testing import build_random_model

    model_dir = build_random_model(tmp_path / "m", "mistral", sliding_window=None)
    prompts = random_prompts(2, 4, 20, seed=3)
    ref = hf_greedy(model_dir, prompts, 6)
    engine = make_engine(model_dir)
    outs = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=6))
    assert [o["output_ids"] for o in outs] == [r[0] for r in ref]
