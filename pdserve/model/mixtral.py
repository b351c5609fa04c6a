"""Mixtral: Mistral's attention with a sparse MoE feed-forward (pdserve.model.moe) in every
layer. Checkpoint: ``block_sparse_moe.gate.weight`` (router) and
``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down); ours is ``mlp``.
A sliding window, if configured, caps the context as for Mistral (ModelConfig.context_limit)."""

from __future__ import annotations

from pdserve.model.model_config import ModelConfig
from pdserve.model.moe import MIXTRAL_EXPERT_NAMES, expert_stacked_params
from pdserve.model.parallel import TPGroup
from pdserve.model.transformer import STACKED_PARAMS, CausalLM


class MixtralForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__(cfg, tp)
        assert cfg.moe is not None
        self.stacked_params = (expert_stacked_params(cfg.moe.num_experts, MIXTRAL_EXPERT_NAMES, "block_sparse_moe")
                               + STACKED_PARAMS)
