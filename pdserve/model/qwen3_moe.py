"""Qwen3-MoE: Qwen3's attention (q/k norm) with sparse MoE feed-forwards (pdserve.model.moe)
in the layers `decoder_sparse_step` / `mlp_only_layers` select, the dense MLP elsewhere.
Checkpoint: ``mlp.gate.weight`` (router) and ``mlp.experts.{e}.{gate,up,down}_proj.weight``."""

from __future__ import annotations

from typing import Any

from pdserve.model.model_config import ModelConfig, MoeFail, MoeLayout
from pdserve.model.moe import QWEN3_MOE_EXPERT_NAMES, expert_stacked_params
from pdserve.model.parallel import TPGroup
from pdserve.model.transformer import STACKED_PARAMS, CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    qk_norm = True
    sliding_window_switch = "use_sliding_window"
    is_moe = True

    @classmethod
    def moe_layout(cls, raw: dict[str, Any], num_layers: int, fail: MoeFail) -> MoeLayout:
        # Qwen3-MoE names it num_experts; transformers 5 writes num_local_experts.
        counts = {raw[k] for k in ("num_experts", "num_local_experts") if raw.get(k) is not None}
        if len(counts) > 1:
            raise fail(f"num_experts and num_local_experts disagree: {sorted(counts)}")
        num_experts = counts.pop() if counts else None
        norm = raw.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise fail(f"norm_topk_prob must be true or false, got {norm!r}")
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
        sparse = tuple(i for i in range(num_layers)
                       if i not in dense and (num_experts or 0) > 0 and (i + 1) % step == 0)
        return num_experts, raw.get("moe_intermediate_size"), norm, sparse

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__(cfg, tp)
        assert cfg.moe is not None
        self.stacked_params = expert_stacked_params(cfg.moe.num_experts, QWEN3_MOE_EXPERT_NAMES) + STACKED_PARAMS
