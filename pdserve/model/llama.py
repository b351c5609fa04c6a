"""Llama 2/3/3.1 (incl. llama3 RoPE scaling) and Mistral: the plain decoder."""

from __future__ import annotations

from pdserve.model.transformer import CausalLM


class LlamaForCausalLM(CausalLM):
    pass


class MistralForCausalLM(LlamaForCausalLM):
    """Same weights and math as Llama; a sliding window, if configured, caps the context
    (see ModelConfig.context_limit) because windowed attention is not implemented."""
