"""GLM-4.5 / GLM-4.5-Air (transformers' Glm4MoeForCausalLM).

Attention: q/k/v biases per ``attention_bias`` (o_proj never has one), an optional
RMSNorm over each q/k head (``use_qk_norm``: GLM-4.5 has it, 4.5-Air not) and partial
RoPE: the first ``head_dim * partial_rotary_factor`` dims of each head (0.5 when the
config has no factor, as in transformers) rotated in the rotate-half layout.

Feed-forward: the first ``first_k_dense_replace`` layers dense (``intermediate_size``),
the others MoE (pdserve.model.moe): sigmoid router scores, the choice corrected by
``e_score_correction_bias`` and grouped (``n_group`` / ``topk_group``), weights
renormalised (``norm_topk_prob``) and scaled (``routed_scaling_factor``), plus
``n_shared_experts`` shared experts (one MLP, ``moe_intermediate_size`` * n wide).

Checkpoint: ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``mlp.shared_experts.{gate,up,down}_proj``.
The ``num_nextn_predict_layers`` MTP layers stored after the decoder's
(``model.layers.{num_hidden_layers}.*``: eh_proj, enorm, hnorm, shared_head, a decoder
layer) are not part of this model: skipped at load. They are the built-in EAGLE draft
(pdserve/speculative/draft_config.py, layout "mtp").
"""

from __future__ import annotations

from typing import Any

from pdserve.model.model_config import ModelConfig, MoeFail, MoeLayout, MoeRouting
from pdserve.model.moe import QWEN3_MOE_EXPERT_NAMES, expert_stacked_params
from pdserve.model.parallel import TPGroup
from pdserve.model.transformer import STACKED_PARAMS, CausalLM

# The routing GLM-4.5 does (transformers hard-codes it): a config naming another is refused.
_GLM_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


class Glm4MoeForCausalLM(CausalLM):
    o_proj_follows_attention_bias = False  # transformers' o_proj has no bias
    qk_norm_switch = "use_qk_norm"
    default_partial_rotary_factor = 0.5
    nextn_layers_key = "num_nextn_predict_layers"
    is_moe = True
    moe_keys = frozenset({"n_shared_experts", "scoring_func", "topk_method", "n_group", "topk_group",
                          "routed_scaling_factor", "first_k_dense_replace"})

    @classmethod
    def moe_layout(cls, raw: dict[str, Any], num_layers: int, fail: MoeFail) -> MoeLayout:
        norm = raw.get("norm_topk_prob", True)  # transformers' default
        if not isinstance(norm, bool):
            raise fail(f"norm_topk_prob must be true or false, got {norm!r}")
        first_dense = _int(raw, "first_k_dense_replace", 1, fail)
        if first_dense < 0:
            raise fail(f"first_k_dense_replace {first_dense} is negative")
        num_experts = raw.get("n_routed_experts")
        sparse = tuple(range(first_dense, num_layers)) if num_experts else ()
        return num_experts, raw.get("moe_intermediate_size"), norm, sparse

    @classmethod
    def moe_routing(cls, raw: dict[str, Any], fail: MoeFail) -> tuple[MoeRouting, int]:
        for key, value in _GLM_ROUTING.items():
            if raw.get(key) not in (None, value):
                raise fail(f"{key}={raw[key]!r} is not supported (GLM-4.5 routes with {key} {value!r})")
        scaling = raw.get("routed_scaling_factor", 1.0)
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
            raise fail(f"routed_scaling_factor must be a number, got {scaling!r}")
        routing = MoeRouting(scoring="sigmoid", num_groups=_int(raw, "n_group", 1, fail),
                             topk_groups=_int(raw, "topk_group", 1, fail), correction_bias=True,
                             scaling_factor=float(scaling))
        shared = _int(raw, "n_shared_experts", 1, fail) * _int(raw, "moe_intermediate_size", 0, fail)
        return routing, shared

    @classmethod
    def stacked_params_for(cls, cfg: ModelConfig) -> tuple[tuple[str, str, object], ...]:
        assert cfg.moe is not None
        return expert_stacked_params(cfg.moe.num_experts, QWEN3_MOE_EXPERT_NAMES) + STACKED_PARAMS

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__(cfg, tp)
        self.stacked_params = self.stacked_params_for(cfg)


def _int(raw: dict[str, Any], key: str, default: int, fail: MoeFail) -> int:
    """``raw[key]`` as an int (``default`` when absent or null), refusing other values by name."""
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(f"{key} must be an integer, got {value!r}")
    return value
