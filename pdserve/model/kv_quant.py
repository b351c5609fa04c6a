"""FP8 KV cache: the formats, per-layer scales, quantisation on write and dequantisation
on read (``--kv-cache-dtype fp8_e4m3 | fp8_e5m2``).

The pool stores one byte per element: ``x_stored = fp8(clamp(x / scale))``, and every
reader computes with ``x = float(x_stored) * scale``. Scales are per layer, one for K
and one for V, read from the target checkpoint when it has them (the names vLLM and
SGLang read, below), else 1.0 (SGLang's default). A checkpoint whose scales are laid
out any other way (per head, per channel, on some layers only, both ``kv_scale`` and
``k_scale``) is refused by name: silently dropping a calibrated scale would quantise
with the wrong range.

Clamping to the format's finite range matters: a plain cast of a value past it gives
NaN in e4m3fn (no infinity) and inf in e5m2, which would poison every later softmax.
"""

from __future__ import annotations

import logging
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# --kv-cache-dtype names -> storage dtypes (OCP e4m3 "fn": finite only, max 448; e5m2: max 57344).
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES.values()


@dataclass(frozen=True)
class KVScales:
    """Per-layer dequantisation scales of an fp8 KV pool (stored * scale = value)."""
    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str = "default 1.0"

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"KV scales: {len(self.k)} K scales but {len(self.v)} V scales")
        bad = [s for s in (*self.k, *self.v) if not (math.isfinite(s) and s > 0)]
        if bad:
            raise ValueError(f"KV scales ({self.source}) must be finite and > 0, got {bad[:4]}")

    @classmethod
    def ones(cls, num_layers: int) -> "KVScales":
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    def digest(self) -> str:
        """A short name of the values, for the PD handshake: both sides must dequantise
        the bytes they exchange with the same scales."""
        if all(s == 1.0 for s in (*self.k, *self.v)):
            return "1.0"
        return f"crc32:{zlib.crc32(repr((self.k, self.v)).encode()):08x}"


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 values of ``x / scale``, saturated to the format's finite range (computed in
    fp32 so that a bf16 input is rounded once)."""
    fmax = torch.finfo(dtype).max
    y = x.float() if scale == 1.0 else x.float() / scale
    return y.clamp_(-fmax, fmax).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    y = x.to(dtype)
    return y if scale == 1.0 else y.mul_(scale)


# ---- scales from a checkpoint ------------------------------------------------------
# model.layers.{i}.self_attn.<suffix>: what it scales. vLLM/SGLang's k_scale / v_scale
# (also under an ``attn.`` submodule), the older shared kv_scale, ModelOpt's
# k_proj.k_scale / v_proj.v_scale and compressed-tensors' k_proj/v_proj.output_scale.
_SUFFIXES = {
    "k_scale": "k", "v_scale": "v", "attn.k_scale": "k", "attn.v_scale": "v", "kv_scale": "kv",
    "k_proj.k_scale": "k", "v_proj.v_scale": "v", "k_proj.output_scale": "k", "v_proj.output_scale": "v",
}
_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(" + "|".join(re.escape(s) for s in _SUFFIXES) + r")$")


def is_kv_scale_name(name: str) -> bool:
    """A checkpoint tensor that is a KV-cache scale (read by ``read_kv_scales``, not a weight)."""
    return _NAME.match(name) is not None


def read_kv_scales(model_dir: Path, num_layers: int) -> KVScales:
    """The checkpoint's per-layer K/V scales, or 1.0 everywhere when it has none."""
    from pdserve.model.loader import checkpoint_files, open_shard  # the loader imports this module

    found: dict[tuple[int, str], tuple[str, float]] = {}
    for path in checkpoint_files(model_dir):
        with open_shard(path) as f:
            for name in f.keys():
                m = _NAME.match(name)
                if m is None:
                    continue
                layer, kind = int(m.group(1)), _SUFFIXES[m.group(2)]
                t = f.get_tensor(name)
                if t.numel() != 1:
                    raise ValueError(f"{model_dir}: {name} has shape {tuple(t.shape)}; pdserve supports one "
                                     "scalar KV scale per layer (per-head or per-channel scales are not supported)")
                if layer >= num_layers:
                    raise ValueError(f"{model_dir}: {name} names layer {layer}, the model has {num_layers}")
                for part in ("k", "v") if kind == "kv" else (kind,):
                    if (layer, part) in found:
                        raise ValueError(f"{model_dir}: layer {layer} has two {part.upper()} scales: "
                                         f"{found[(layer, part)][0]} and {name}")
                    found[(layer, part)] = (name, float(t.float().item()))
    if not found:
        return KVScales.ones(num_layers)
    missing = [f"{i}.{p}_scale" for i in range(num_layers) for p in ("k", "v") if (i, p) not in found]
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint has KV scales for some layers but not for "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; refusing to guess 1.0")
    scales = KVScales(tuple(found[(i, "k")][1] for i in range(num_layers)),
                      tuple(found[(i, "v")][1] for i in range(num_layers)), source=f"checkpoint {model_dir}")
    logger.info("fp8 KV scales from the checkpoint: K %s, V %s", scales.k, scales.v)
    return scales
