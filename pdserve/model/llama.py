"""Llama 2/3/3.1 (incl. llama3 RoPE scaling) and Mistral: the plain decoder."""

from __future__ import annotations

from pdserve.model.transformer import CausalLM


class LlamaForCausalLM(CausalLM):
    speculative_defaults = (5, 4, 8)  # SGLang's default tree for Llama targets


class MistralForCausalLM(LlamaForCausalLM):
    """Same weights and math as Llama; a sliding window, if configured, caps the context
    (see ModelConfig.context_limit) because windowed attention is not implemented."""
    speculative_defaults = (3, 1, 4)  # SGLang's default chain (its tree default is Llama's only)
