"""--tp-size 2 (gloo, two scheduler processes) gives the single-process tokens."""

from __future__ import annotations

import pytest

from tests.conftest import GREEDY, random_prompts

PROMPTS = random_prompts(4, 5, 60, seed=21)


@pytest.mark.parametrize("name", ["llama_gqa", "llama3_rope", "qwen2"])
def test_tp2_matches_tp1(name, model_dirs, make_engine):
    # llama3_rope has a single KV head: TP 2 replicates it on both ranks.
    model_dir = model_dirs(name)
    params = dict(GREEDY, max_new_tokens=12)
    tp1 = make_engine(model_dir).generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True)
    tp2 = make_engine(model_dir, tp_size=2, chunked_prefill_size=32).generate(
        input_ids=PROMPTS, sampling_params=params, return_logprob=True)
    for a, b in zip(tp1, tp2):
        assert a["output_ids"] == b["output_ids"]
        la = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lb = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4


def test_tp_size_must_divide_heads(model_dirs):
    from pdserve import Engine
    from pdserve.config import ConfigError

    with pytest.raises(ConfigError, match="--tp-size 3"):
        Engine(model_path=str(model_dirs("llama_gqa")), tp_size=3, max_total_tokens=1024)
