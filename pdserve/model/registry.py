"""Model architectures by Hugging Face name (config.json ``architectures``), each
imported only when used.

An architecture is a CausalLM subclass (pdserve/model/transformer.py) whose class
attributes say how its config.json is read; ModelConfig.from_hf asks them, never
the name. Adding an architecture is one module holding its class and one line in
``ARCHITECTURES``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, cast

from pdserve.lazy import load_target
from pdserve.model.model_config import ModelConfig, ModelConfigError

if TYPE_CHECKING:
    from pdserve.model.transformer import CausalLM

# Hugging Face architecture name -> "module:Class", imported on first use.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "pdserve.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pdserve.model.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "pdserve.model.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pdserve.model.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "pdserve.model.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "pdserve.model.mixtral:MixtralForCausalLM",
    "Glm4MoeForCausalLM": "pdserve.model.glm4_moe:Glm4MoeForCausalLM",
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(ARCHITECTURES)


def _unsupported(what: object) -> ModelConfigError:
    return ModelConfigError(f"unsupported architecture {what!r}; supported: {', '.join(ARCHITECTURES)}")


def architecture_class(name: str) -> type[CausalLM]:
    """The class registered as ``name``, imported now (ModelConfigError listing the
    supported names if there is none)."""
    path = ARCHITECTURES.get(name)
    if path is None:
        raise _unsupported(name)
    return cast("type[CausalLM]", load_target(path))


def find_architecture(archs: Sequence[str]) -> tuple[str, type[CausalLM]]:
    """The first of a config's ``architectures`` that is registered, and its class."""
    for name in archs:
        if name in ARCHITECTURES:
            return name, architecture_class(name)
    raise _unsupported(archs)


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    return architecture_class(cfg.architecture)
