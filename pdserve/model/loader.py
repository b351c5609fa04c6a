"""Hugging Face safetensors loading with a strict name/shape check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from pdserve.model.layers import WeightShapeError
from pdserve.model.transformer import CausalLM


class WeightLoadError(ValueError):
    pass


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"{index}: shard files missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{model_dir}: no *.safetensors files (only safetensors checkpoints "
                              "are supported)")
    return files


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: CausalLM, model_dir: Path, rename: Callable[[str], str | None] | None = None) -> None:
    """Load every parameter of `model`; raise listing missing and unexpected names.

    `rename` maps a checkpoint tensor name to the model's naming (None: skip the
    tensor); draft heads use it for their layouts."""
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    # (our parameter name, shard) -> checkpoint name, for the missing-name report.
    expected: dict[tuple[str, object], str] = {}
    for name in params:
        if tied and name == "lm_head.weight":
            continue
        shards = [(theirs, shard) for ours, theirs, shard in model.stacked_params if f".{ours}." in name]
        for theirs, shard in shards:
            ours = next(o for o, t, _ in model.stacked_params if t == theirs)
            expected[(name, shard)] = name.replace(f".{ours}.", f".{theirs}.")
        if not shards:
            expected[(name, None)] = name
    seen: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in iter_checkpoint(model_dir):
        if ckpt_name.endswith(model.ignored_suffixes) or (tied and ckpt_name == "lm_head.weight"):
            continue
        if rename is not None:
            renamed = rename(ckpt_name)
            if renamed is None:
                continue
            ckpt_name = renamed
        target, shard = _map_name(model, ckpt_name)
        param = params.get(target)
        if param is None or (target, shard) not in expected:
            unexpected.append(ckpt_name)
            continue
        try:
            param.weight_loader(tensor, shard)  # type: ignore[attr-defined]
        except WeightShapeError as exc:
            raise WeightShapeError(f"{model_dir}: {ckpt_name}: {exc}") from None
        seen.add((target, shard))
        if tied and ckpt_name == "model.embed_tokens.weight":
            params["lm_head.weight"].weight_loader(tensor, None)  # type: ignore[attr-defined]
    missing = sorted(v for k, v in expected.items() if k not in seen)
    if missing or unexpected:
        lines = [f"{model_dir}: checkpoint does not match {type(model).__name__}"]
        if missing:
            lines.append(f"  missing tensors ({len(missing)}): {', '.join(missing[:20])}"
                         + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            lines.append(f"  unexpected tensors ({len(unexpected)}): {', '.join(sorted(unexpected)[:20])}"
                         + (" ..." if len(unexpected) > 20 else ""))
        raise WeightLoadError("\n".join(lines))


def _map_name(model: CausalLM, ckpt_name: str) -> tuple[str, object]:
    for ours, theirs, shard in model.stacked_params:
        if f".{theirs}." in ckpt_name:
            return ckpt_name.replace(f".{theirs}.", f".{ours}."), shard
    return ckpt_name, None
