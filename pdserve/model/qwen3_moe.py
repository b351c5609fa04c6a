"""Qwen3-MoE: Qwen3's attention (q/k norm) with sparse MoE feed-forwards (pdserve.model.moe)
in the layers `decoder_sparse_step` / `mlp_only_layers` select, the dense MLP elsewhere.
Checkpoint: ``mlp.gate.weight`` (router) and ``mlp.experts.{e}.{gate,up,down}_proj.weight``."""

from __future__ import annotations

from pdserve.model.model_config import ModelConfig
from pdserve.model.moe import QWEN3_MOE_EXPERT_NAMES, expert_stacked_params
from pdserve.model.parallel import TPGroup
from pdserve.model.transformer import STACKED_PARAMS, CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__(cfg, tp)
        assert cfg.moe is not None
        self.stacked_params = expert_stacked_params(cfg.moe.num_experts, QWEN3_MOE_EXPERT_NAMES) + STACKED_PARAMS
