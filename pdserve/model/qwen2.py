"""Qwen2: Llama layout with biases on the q/k/v projections (ModelConfig.attention_bias)."""

from __future__ import annotations

from pdserve.model.transformer import CausalLM


class Qwen2ForCausalLM(CausalLM):
    qkv_bias = True                         # always, whatever attention_bias says
    o_proj_follows_attention_bias = False   # no o_proj bias, as in transformers
    sliding_window_switch = "use_sliding_window"
