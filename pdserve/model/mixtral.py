"""Mixtral: Mistral's attention with a sparse MoE feed-forward (pdserve.model.moe) in every
layer. Checkpoint: ``block_sparse_moe.gate.weight`` (router) and
``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down); ours is ``mlp``.
A sliding window, if configured, caps the context as for Mistral (ModelConfig.context_limit)."""

from __future__ import annotations

from typing import Any

from pdserve.model.model_config import ModelConfig, MoeFail, MoeLayout
from pdserve.model.moe import MIXTRAL_EXPERT_NAMES, expert_stacked_params
from pdserve.model.parallel import TPGroup
from pdserve.model.transformer import STACKED_PARAMS, CausalLM


class MixtralForCausalLM(CausalLM):
    reads_attention_bias = False  # transformers' Mixtral has no attention biases
    is_moe = True

    @classmethod
    def moe_layout(cls, raw: dict[str, Any], num_layers: int, fail: MoeFail) -> MoeLayout:
        # Every layer is sparse; Mixtral always renormalises the chosen experts' probabilities.
        return raw.get("num_local_experts"), raw.get("intermediate_size"), True, tuple(range(num_layers))

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__(cfg, tp)
        assert cfg.moe is not None
        self.stacked_params = (expert_stacked_params(cfg.moe.num_experts, MIXTRAL_EXPERT_NAMES, "block_sparse_moe")
                               + STACKED_PARAMS)
