"""Qwen3: Llama layout plus an RMSNorm over each q and k head before RoPE
(ModelConfig.qk_norm; weights `self_attn.q_norm` / `self_attn.k_norm`). Its
projections' biases (q/k/v and o) follow attention_bias, as in transformers."""

from __future__ import annotations

from pdserve.model.transformer import CausalLM


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True
    sliding_window_switch = "use_sliding_window"
