"""YaRN RoPE scaling (Qwen3's long-context setting) against transformers: the resolved
parameters, the cos/sin tables, and a tiny model's greedy tokens and logprobs."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.layers import RotaryEmbedding, rope_inv_freq
from pdserve.model.model_config import ModelConfig, ModelConfigError
from pdserve.testing import build_random_model
from tests.conftest import GREEDY, hf_greedy, random_prompts

pytestmark = pytest.mark.fast

QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
SCALINGS = {
    "qwen3": QWEN3_YARN,
    "betas-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0},
    "attention-factor-untruncated": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                                     "truncate": False, "attention_factor": 1.3},
    "old-key-no-original": {"type": "yarn", "factor": 3.0},
}


def _hf_config(scaling: dict, head_dim: int = 128, max_pos: int = 131072):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=head_dim,
                       max_position_embeddings=max_pos, rope_theta=1e6, rope_scaling=dict(scaling))


def _ours(hf_cfg) -> ModelConfig:
    raw = hf_cfg.to_dict()
    raw["architectures"] = ["Qwen3ForCausalLM"]
    return ModelConfig.from_hf(raw)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_yarn_parameters_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = _hf_config(SCALINGS[name])
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    rope = _ours(hf_cfg).rope
    assert rope.rope_type == "yarn"
    assert rope.attention_factor == pytest.approx(want_factor, rel=1e-12)
    got = rope_inv_freq(128, rope)
    # Ours is computed in float64 and rounded once; transformers' in float32: within 2 ulps.
    torch.testing.assert_close(got, want_inv, rtol=2.5e-7, atol=0)
    # Not the plain RoPE: the low frequencies are interpolated.
    plain = rope_inv_freq(128, type(rope)(theta=rope.theta))
    assert float((got / plain).min()) == pytest.approx(1 / rope.factor, rel=1e-5)


def test_qwen3_long_context_values():
    """Qwen3's documented setting: factor 4 over 32768 -> attention factor 0.1 ln 4 + 1."""
    rope = _ours(_hf_config(QWEN3_YARN)).rope
    assert (rope.factor, rope.original_max_position_embeddings) == (4.0, 32768)
    assert rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1, rel=1e-7)
    assert (rope.beta_fast, rope.beta_slow, rope.truncate) == (32.0, 1.0, True)


@pytest.mark.parametrize("name", ["qwen3", "betas-mscale", "attention-factor-untruncated"])
def test_cos_sin_tables_match_transformers_rotary_embedding(name):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    hf_cfg = _hf_config(SCALINGS[name])
    positions = torch.arange(0, 8192)
    cos, sin = Qwen3RotaryEmbedding(hf_cfg)(torch.zeros(1), positions[None])
    ours = RotaryEmbedding(128, 8192, _ours(hf_cfg).rope)
    got_cos, got_sin = ours.cos_sin(positions)
    # transformers' tables repeat the half-dim table twice (rotate-half layout).
    assert torch.equal(cos[0, :, :64], cos[0, :, 64:])
    # Both tables are float32 products position x frequency: they differ by the rounding of
    # the angle (~1e-7 relative), so the bound grows with the position.
    bound = 3e-7 * (positions.float() + 1).unsqueeze(1) * ours.cos.abs().max() + 1e-6
    for want, got in ((cos[0, :, :64], got_cos[:, 0]), (sin[0, :, :64], got_sin[:, 0])):
        assert bool(((want - got).abs() <= bound).all()), float((want - got).abs().max())
    # The attention factor scales both tables (position 0: cos = factor, sin = 0).
    assert float(got_cos[0].max()) == pytest.approx(_ours(hf_cfg).rope.attention_factor, rel=1e-6)


def test_yarn_refusals():
    with pytest.raises(ModelConfigError, match="yarn factor 0.5 is below 1"):
        _ours(_hf_config({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}))
    with pytest.raises(ModelConfigError, match="beta_fast 1.0 is below beta_slow 4.0"):
        _ours(_hf_config({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                          "beta_fast": 1, "beta_slow": 4}))
    raw = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4,
           "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}
    with pytest.raises(ModelConfigError, match="'longrope' is not supported"):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_yarn_model_matches_transformers(tmp_path, make_engine, arch):
    """Pretraining length 32, factor 4: prompts and outputs run well past it."""
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if arch == "qwen3_moe" else {}
    model_dir = build_random_model(tmp_path / "m", arch, num_heads=4, num_kv_heads=2, rope_theta=10000.0,
                                   rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 32}, **extra)
    rope = ModelConfig.from_dir(model_dir).rope
    assert rope.rope_type == "yarn" and rope.attention_factor > 1.1
    prompts = random_prompts(4, 20, 90, seed=7)
    ref = hf_greedy(model_dir, prompts, 16)
    engine = make_engine(model_dir)
    outs = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=16), return_logprob=True)
    for (ref_ids, ref_lps), out in zip(ref, outs):
        assert out["output_ids"] == ref_ids
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lps, ref_lps)) < 1e-4
