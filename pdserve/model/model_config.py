"""What the engine needs to know about a Hugging Face checkpoint, read from config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    pass


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool   # q/k/v (and o for Llama) projections carry a bias
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool          # Qwen3: RMSNorm over each head of q and k before RoPE
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # Sliding-window attention is not implemented: such models are capped to the window.
    sliding_window: int | None

    @property
    def context_limit(self) -> int:
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
        raw: dict[str, Any] = json.loads(path.read_text())
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_hf(raw, gen)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelConfigError(f"num_attention_heads {heads} is not a multiple of "
                                   f"num_key_value_heads {kv_heads}")
        if raw.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelConfigError("partial_rotary_factor != 1 is not supported")
        is_qwen = arch.startswith("Qwen")
        sliding = raw.get("sliding_window")
        if is_qwen and not raw.get("use_sliding_window", False):
            sliding = None
        eos = _eos_ids(raw, generation or {})
        max_pos = int(raw.get("max_position_embeddings", 2048))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope=_rope_config(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)) or arch == "Qwen2ForCausalLM",
            o_proj_bias=bool(raw.get("attention_bias", False)) and not is_qwen,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_window=int(sliding) if sliding else None,
        )


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    value = generation.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or None
    theta = float(raw.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0)
    if not scaling:
        return RopeConfig(theta=theta)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(scaling["factor"]))
    if rope_type == "llama3":
        return RopeConfig(
            theta=theta, rope_type="llama3", factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    raise ModelConfigError(f"rope_scaling type {rope_type!r} is not supported "
                           "(supported: default, linear, llama3)")
