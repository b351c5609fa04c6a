"""Qwen2: Llama layout with biases on the q/k/v projections (ModelConfig.attention_bias)."""

from __future__ import annotations

from pdserve.model.transformer import CausalLM


class Qwen2ForCausalLM(CausalLM):
    pass
