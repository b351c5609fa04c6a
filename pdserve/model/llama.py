"""Llama 2/3/3.1 (incl. llama3 RoPE scaling) and Mistral: the plain decoder."""

from __future__ import annotations

from pdserve.model.transformer import CausalLM


class LlamaForCausalLM(CausalLM):
    # The chain (3, 1, 4), not SGLang's (5, 4, 8) tree for Llama targets: on pdserve's
    # measurements (docs/benchmarks.md, "Speculative decoding (EAGLE, EAGLE3) on the demo
    # model") the chain is ahead of the tree at every batch size, EAGLE 1.22x / 1.05x /
    # 0.87x of plain decoding at batch 1 / 8 / 32 against 1.14x / 0.99x / 0.71x (EAGLE3
    # 1.05x / 1.03x / 0.85x against 0.97x / 0.90x / 0.68x), and served at concurrency 1
    # 1.16x against 1.00x: the tree verifies 8 tokens per request per round, which a
    # batch pays for once the forward is compute-bound. SGLang's own auto choice is a
    # chain of this size too.
    speculative_defaults = (3, 1, 4)


class MistralForCausalLM(LlamaForCausalLM):
    """Same weights and math as Llama; a sliding window, if configured, caps the context
    (see ModelConfig.context_limit) because windowed attention is not implemented."""
    speculative_defaults = (3, 1, 4)  # SGLang's default chain (its tree default is Llama's only)
