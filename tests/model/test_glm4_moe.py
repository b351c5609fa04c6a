"""GLM-4.5 (Glm4MoeForCausalLM) against transformers on tiny random GLM-4.5-shaped
checkpoints (pdserve.testing ARCH_DEFAULTS): greedy tokens and logprobs at TP 1 and TP 2,
through chunked prefill and the radix cache; its router and partial RoPE against
transformers' own modules; the NextN layer's tensors skipped; refusals of what pdserve
does not implement."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.model.layers import RotaryEmbedding
from pdserve.model.loader import WeightLoadError, build_model
from pdserve.model.model_config import ModelConfig, ModelConfigError, MoeRouting, RopeConfig
from pdserve.model.moe import Router
from pdserve.model.parallel import TPGroup
from pdserve.model.registry import model_class
from pdserve.testing import build_random_model
from tests.conftest import GREEDY, hf_greedy, random_prompts
from tests.model.test_moe import _ids_and_lps, assert_matches, check_greedy_parity

NEW = 12


@pytest.fixture(scope="module")
def glm_dirs(tmp_path_factory):
    """GLM-4.5-shaped (grouped routing 2 of 4 groups, q/k norm off, half the head dims
    rotated) and GLM-4.5-shaped with q/k norm, a quarter rotated and one group (Air's routing)."""
    built = {}

    def get(name: str):
        if name not in built:
            specs = {"glm4_moe": {},
                     "glm4_moe_qk_norm": dict(use_qk_norm=True, partial_rotary_factor=0.25, n_group=1, topk_group=1,
                                              routed_scaling_factor=1.0, num_experts_per_tok=2, seed=1)}
            built[name] = build_random_model(tmp_path_factory.mktemp(name), "glm4_moe", num_layers=3, **specs[name])
        return built[name]
    return get


def _model(d, tp=TPGroup(), dtype=torch.float32):
    cfg = ModelConfig.from_dir(d)
    return build_model(lambda: model_class(cfg)(cfg, tp), d, "cpu", dtype)


# ---- the checkpoint and its config ------------------------------------------------------------------
@pytest.mark.fast
def test_config_and_layers_are_glm_shaped(glm_dirs):
    d = glm_dirs("glm4_moe")
    cfg = ModelConfig.from_dir(d)
    assert cfg.architecture == "Glm4MoeForCausalLM"
    assert cfg.attention_bias and not cfg.o_proj_bias and not cfg.qk_norm and cfg.nextn_layers == 1
    assert cfg.rope.partial_rotary_factor == 0.5 and cfg.rope.rotary_dim(cfg.head_dim) == 8
    moe = cfg.moe
    assert moe is not None and moe.sparse_layers == (1, 2) and moe.norm_topk_prob
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size) == (8, 3, 32, 32)
    assert moe.routing == MoeRouting("sigmoid", num_groups=4, topk_groups=2, correction_bias=True,
                                     scaling_factor=2.5)
    assert ModelConfig.from_dir(glm_dirs("glm4_moe_qk_norm")).qk_norm
    model = _model(d)
    assert len(model.model.layers) == 3  # the NextN layer (model.layers.3.*) is not built
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["MLP", "SparseMoeBlock", "SparseMoeBlock"]
    ckpt = load_file(str(d / "model.safetensors"))
    assert "model.layers.3.eh_proj.weight" in ckpt and "model.layers.3.mlp.experts.7.down_proj.weight" in ckpt
    block = model.model.layers[2].mlp
    assert torch.equal(block.gate.e_score_correction_bias, ckpt["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert float(block.gate.e_score_correction_bias.abs().min()) > 0
    half = 32  # shared_experts: gate rows, then up rows
    assert torch.equal(block.shared_experts.gate_up_proj.weight[:half],
                       ckpt["model.layers.2.mlp.shared_experts.gate_proj.weight"])
    assert torch.equal(block.shared_experts.down_proj.weight, ckpt["model.layers.2.mlp.shared_experts.down_proj.weight"])
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.bias[:64],
                       ckpt["model.layers.0.self_attn.q_proj.bias"])


@pytest.mark.fast
def test_router_bias_stays_fp32_in_a_bf16_model(glm_dirs):
    d = glm_dirs("glm4_moe")
    model = _model(d, dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.bfloat16 and gate.e_score_correction_bias.dtype == torch.float32
    want = load_file(str(d / "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(gate.e_score_correction_bias, want)  # not rounded to bf16


# ---- greedy parity with transformers ------------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("name", ["glm4_moe", "glm4_moe_qk_norm"])
def test_greedy_tokens_and_logprobs_match_transformers(name, glm_dirs, make_engine):
    check_greedy_parity(glm_dirs(name), make_engine, seed=len(name), new=NEW)


@pytest.mark.fast
def test_chunked_prefill_and_radix_cache_match_transformers(glm_dirs, make_engine):
    """Prompts sharing a 40-token prefix, prefilled in chunks of 16: the second request
    over the prefix reads its KV from the radix cache, and every token still matches."""
    d = glm_dirs("glm4_moe")
    prefix = random_prompts(1, 40, 40, seed=7)[0]
    tails = random_prompts(3, 5, 20, seed=8)
    prompts = [prefix + t for t in tails]
    ref = hf_greedy(d, prompts, NEW)
    engine = make_engine(d, chunked_prefill_size=16)
    params = dict(GREEDY, max_new_tokens=NEW)
    first = engine.generate(input_ids=prompts[0], sampling_params=params, return_logprob=True)
    rest = engine.generate(input_ids=prompts[1:], sampling_params=params, return_logprob=True)
    assert all(o["meta_info"]["cached_tokens"] >= 32 for o in rest)  # the prefix, in cache
    again = engine.generate(input_ids=prompts[0], sampling_params=params, return_logprob=True)
    assert again["meta_info"]["cached_tokens"] >= len(prompts[0]) - 1
    assert_matches([_ids_and_lps(o) for o in [first, *rest, again]], ref + ref[:1])


@pytest.mark.parametrize("name", ["glm4_moe", "glm4_moe_qk_norm"])
def test_tp2_matches_transformers(name, glm_dirs, make_engine):
    """TP 2 (two gloo ranks): heads, the dense MLP, every expert and the shared expert
    split in halves; routed and shared partial sums reduced once per MoE layer."""
    d = glm_dirs(name)
    prompts = random_prompts(3, 5, 60, seed=21)
    ref = hf_greedy(d, prompts, NEW)
    engine = make_engine(d, tp_size=2, chunked_prefill_size=32)
    params = dict(GREEDY, max_new_tokens=NEW)
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    assert_matches([_ids_and_lps(o) for o in outs], ref)
    again = engine.generate(input_ids=prompts[0], sampling_params=params, return_logprob=True)
    assert again["meta_info"]["cached_tokens"] > 0
    assert_matches([_ids_and_lps(again)], ref[:1])


@pytest.mark.fast
def test_tp_shards_sum_to_the_full_layer(glm_dirs):
    """Rank 0 + rank 1 of a MoE layer (routed and shared experts, left unreduced by a
    TPGroup without a process group) give the TP 1 layer's output."""
    d = glm_dirs("glm4_moe")
    full = _model(d).model.layers[1].mlp
    halves = [_model(d, TPGroup(rank=r, size=2)).model.layers[1].mlp for r in (0, 1)]
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    want = full(x)
    parts = []
    for h in halves:
        ids, weights = h.gate(x)
        parts.append(h.experts(x, ids, weights) + h.shared_experts(x))
    torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=1e-5)
    # Without the shared expert the output differs: it is really added.
    ids, weights = full.gate(x)
    assert float((full.experts(x, ids, weights) - want).abs().max()) > 1e-2


# ---- the router and partial RoPE against transformers' modules ----------------------------------------
def _hf_router(num_experts, top_k, groups, keep, norm, scaling, seed):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = Glm4MoeConfig(hidden_size=16, n_routed_experts=num_experts, num_experts_per_tok=top_k, n_group=groups,
                        topk_group=keep, norm_topk_prob=norm, routed_scaling_factor=scaling)
    hf = Glm4MoeTopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(num_experts, 16, generator=g))
        hf.e_score_correction_bias.copy_(torch.randn(num_experts, generator=g) * 0.3)
    ours = Router(num_experts, 16, top_k, norm, MoeRouting("sigmoid", groups, keep, True, scaling))
    ours.weight.data.copy_(hf.weight)
    ours.e_score_correction_bias.data.copy_(hf.e_score_correction_bias)
    return hf, ours


def _by_expert(ids: torch.Tensor, weights: torch.Tensor) -> list[dict[int, float]]:
    return [{int(e): float(w) for e, w in zip(i, ws)} for i, ws in zip(ids, weights)]


@pytest.mark.fast
@pytest.mark.parametrize("experts,top_k,groups,keep,norm,scaling", [
    (8, 3, 4, 2, True, 2.5), (16, 4, 4, 1, True, 1.0), (8, 2, 1, 1, False, 1.5), (12, 5, 3, 3, True, 2.0)])
def test_router_matches_transformers(experts, top_k, groups, keep, norm, scaling):
    hf, ours = _hf_router(experts, top_k, groups, keep, norm, scaling, seed=experts + top_k)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hf_weights, hf_ids = hf(x)
        ids, weights = ours(x)
    got, want = _by_expert(ids, weights), _by_expert(hf_ids, hf_weights)
    assert [set(g) for g in got] == [set(w) for w in want]
    for g, w in zip(got, want):
        for e in w:
            assert g[e] == pytest.approx(w[e], rel=1e-6, abs=1e-7)


@pytest.mark.fast
def test_router_chooses_with_the_corrected_scores_and_weighs_with_the_raw_ones():
    _, ours = _hf_router(8, 3, 4, 2, False, 1.0, seed=3)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    ids, weights = ours(x)
    scores = torch.sigmoid(x @ ours.weight.T)
    torch.testing.assert_close(weights, scores.gather(1, ids))  # uncorrected, unnormalised
    bias = ours.e_score_correction_bias.data.clone()
    ours.e_score_correction_bias.data.zero_()
    plain_ids, _ = ours(x)
    ours.e_score_correction_bias.data.copy_(bias)
    assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(ids, plain_ids))  # the bias changes choices
    # Grouping: every token's experts lie in at most topk_group (2) of the 4 groups of 2.
    assert all(len({int(e) // 2 for e in row}) <= 2 for row in ids)
    ungrouped = Router(8, 16, 3, False, MoeRouting("sigmoid", 1, 1, True, 1.0))
    ungrouped.weight.data.copy_(ours.weight)
    ungrouped.e_score_correction_bias.data.copy_(bias)
    assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(ids, ungrouped(x)[0]))


@pytest.mark.fast
@pytest.mark.parametrize("factor", [0.5, 0.25, 1.0])
def test_partial_rotary_matches_transformers(factor):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

    head_dim = 32
    cfg = Glm4MoeConfig(hidden_size=128, num_attention_heads=4, head_dim=head_dim, partial_rotary_factor=factor,
                        rope_theta=5000.0, max_position_embeddings=256)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(20, 4, head_dim, generator=g), torch.randn(20, 2, head_dim, generator=g)
    pos = torch.randint(0, 256, (20,), generator=g)
    cos, sin = Glm4MoeRotaryEmbedding(cfg)(q, pos.unsqueeze(0))
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin)
    rope = RotaryEmbedding(head_dim, 256, RopeConfig(theta=5000.0, partial_rotary_factor=factor))
    assert rope.rotary_dim == int(head_dim * factor)
    got_q, got_k = rope(q, k, rope.cos_sin(pos))
    # Angles up to 255 rad: ours from a float64 inverse frequency, transformers' in float32.
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-4, atol=1e-4)
    if factor < 1:
        assert torch.equal(got_q[..., rope.rotary_dim:], q[..., rope.rotary_dim:])  # passed through


# ---- the NextN layer's tensors ------------------------------------------------------------------------
def _edited(src, dst, edit_ckpt=None, edit_cfg=None):
    shutil.copytree(src, dst)
    if edit_ckpt is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_ckpt(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_cfg is not None:
        raw = json.loads((dst / "config.json").read_text())
        edit_cfg(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.fast
def test_only_the_declared_nextn_layers_are_skipped(glm_dirs, tmp_path):
    src = glm_dirs("glm4_moe")
    # Without num_nextn_predict_layers the layer-3 tensors are a mismatch, reported by name.
    d = _edited(src, tmp_path / "no_key", edit_cfg=lambda raw: raw.update(num_nextn_predict_layers=0))
    with pytest.raises(WeightLoadError, match=r"unexpected tensors \(\d+\): model.layers.3.eh_proj.weight"):
        _model(d)
    # A tensor past the declared NextN layer is still refused.
    d = _edited(src, tmp_path / "extra", edit_ckpt=lambda t: t.update({"model.layers.4.enorm.weight": torch.ones(64)}))
    with pytest.raises(WeightLoadError, match=r"unexpected tensors \(1\): model.layers.4.enorm.weight"):
        _model(d)
    # The MoE tensors are checked as ever: a missing correction bias is named.
    d = _edited(src, tmp_path / "missing",
                edit_ckpt=lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"))
    with pytest.raises(WeightLoadError, match=r"missing tensors \(1\): model.layers.1.mlp.gate.e_score_correction_bias"):
        _model(d)


# ---- refusals -----------------------------------------------------------------------------------------
def _raw(**changes):
    base = {"architectures": ["Glm4MoeForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
            "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "partial_rotary_factor": 0.5,
            "rope_theta": 1e6, "rope_scaling": None, "num_nextn_predict_layers": 1}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


@pytest.mark.fast
@pytest.mark.parametrize("changes,match", [
    ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
    ({"n_group": 3}, "n_group 3 must divide the number of experts"),
    ({"topk_group": 3}, "topk_group 3 must be between 1 and n_group"),
    ({"n_group": 8, "topk_group": 1}, "leaves 1 expert per group"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 exceeds the 4 experts"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor 0.0 must be positive"),
    ({"routed_scaling_factor": "2"}, "routed_scaling_factor must be a number"),
    ({"n_group": 2.0}, "n_group must be an integer"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
    ({"partial_rotary_factor": 0.0}, r"partial_rotary_factor 0.0 must be in \(0, 1\]"),
    ({"partial_rotary_factor": 0.1}, "rotates 1 of the 16 head dims; RoPE needs an even number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor values disagree"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"partial_rotary_factor": "half"}, "partial_rotary_factor must be a number, got 'half'"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers must be a count"),
])
def test_unsupported_glm_configs_are_refused(changes, match):
    with pytest.raises(ModelConfigError, match=match) as info:
        ModelConfig.from_hf(_raw(**changes))
    if "rope_scaling" not in changes:  # the RoPE reader names no architecture (shared by all)
        assert str(info.value).startswith("Glm4MoeForCausalLM")


@pytest.mark.fast
def test_config_defaults_follow_transformers():
    """A config.json without the optional keys reads as transformers' Glm4MoeConfig does:
    half the dims rotated, one shared expert, renormalised weights, no grouping, no scaling."""
    cfg = ModelConfig.from_hf(_raw(partial_rotary_factor=None, n_group=None, topk_group=None, n_shared_experts=None,
                                   first_k_dense_replace=None, num_nextn_predict_layers=None))
    assert cfg.rope.partial_rotary_factor == 0.5 and cfg.nextn_layers == 0 and not cfg.qk_norm
    assert cfg.moe.sparse_layers == (1, 2) and cfg.moe.norm_topk_prob and cfg.moe.shared_intermediate_size == 32
    assert cfg.moe.routing == MoeRouting("sigmoid", 1, 1, True, 1.0)
    # transformers 5 writes the factor into rope_parameters.
    nested = ModelConfig.from_hf(_raw(partial_rotary_factor=None, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}))
    assert nested.rope.partial_rotary_factor == 0.25 and nested.rope.theta == 1e6
    assert ModelConfig.from_hf(_raw(use_qk_norm=True)).qk_norm


@pytest.mark.fast
def test_other_architectures_still_refuse_glm_settings():
    qwen = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    with pytest.raises(ModelConfigError, match="partial_rotary_factor=0.5 is not supported"):
        ModelConfig.from_hf({**qwen, "partial_rotary_factor": 0.5})
    with pytest.raises(ModelConfigError, match="n_group=2 is not supported"):
        ModelConfig.from_hf({**qwen, "n_group": 2})
    plain = ModelConfig.from_hf({**qwen, "use_qk_norm": False, "num_nextn_predict_layers": 1})
    assert plain.qk_norm and plain.nextn_layers == 0 and plain.moe.routing == MoeRouting()


@pytest.mark.fast
def test_engine_refuses_an_unsupported_glm_checkpoint_at_load(glm_dirs, tmp_path):
    from pdserve import Engine

    d = _edited(glm_dirs("glm4_moe"), tmp_path / "m", edit_cfg=lambda raw: raw.update(topk_method="greedy"))
    with pytest.raises(ModelConfigError, match="Glm4MoeForCausalLM: topk_method='greedy' is not supported"):
        Engine(model_path=str(d), max_total_tokens=1024)
