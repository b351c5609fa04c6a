"""Hugging Face architecture name -> model class."""

from __future__ import annotations

from pdserve.model.llama import LlamaForCausalLM, MistralForCausalLM
from pdserve.model.mixtral import MixtralForCausalLM
from pdserve.model.model_config import ModelConfig, ModelConfigError
from pdserve.model.qwen2 import Qwen2ForCausalLM
from pdserve.model.qwen3 import Qwen3ForCausalLM
from pdserve.model.qwen3_moe import Qwen3MoeForCausalLM
from pdserve.model.transformer import CausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    try:
        return ARCHITECTURES[cfg.architecture]
    except KeyError:
        raise ModelConfigError(f"unsupported architecture {cfg.architecture!r}") from None
