"""Hugging Face checkpoint loading with a strict name/shape check.

Checkpoints are safetensors (``*.safetensors``, sharded with
``model.safetensors.index.json``) or, when a directory has none, PyTorch's
``pytorch_model.bin`` (sharded with ``pytorch_model.bin.index.json``), which many
public EAGLE heads ship. Those are pickles: they are read with
``torch.load(weights_only=True, mmap=True)``, which rebuilds tensors and plain
containers only and refuses any other object (a pickle can run code when loaded), so
no code from a checkpoint ever runs.

`build_model` is how the engine gets its weights: the module is constructed on the
meta device (no storage), given uninitialised storage on the target device in the
target dtype, then filled from the checkpoint one tensor at a time (each read from
its shard, handed to its parameter's `weight_loader`, which copies this rank's slice
into the device parameter, casting on the way, and dropped before the next read).
Host memory therefore holds about one checkpoint tensor, never a model copy, plus
the pages of the one shard open (memory-mapped: file-backed, reclaimable).
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from pdserve.model.kv_quant import is_kv_scale_name
from pdserve.model.layers import LMHead, WeightShapeError

M = TypeVar("M", bound=nn.Module)


class WeightLoadError(ValueError):
    pass


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shard files: safetensors when the directory has them, else
    PyTorch's pytorch_model.bin (each sharded through its index or not)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return _indexed_shards(index)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    index = model_dir / "pytorch_model.bin.index.json"
    if index.is_file():
        return _indexed_shards(index)
    if (model_dir / "pytorch_model.bin").is_file():
        return [model_dir / "pytorch_model.bin"]
    raise WeightLoadError(f"{model_dir}: no checkpoint: expected *.safetensors (sharded: with "
                          "model.safetensors.index.json) or pytorch_model.bin (sharded: with "
                          "pytorch_model.bin.index.json)")


def _indexed_shards(index: Path) -> list[Path]:
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise WeightLoadError(f"{index}: not a checkpoint index ({type(exc).__name__}: {exc})") from None
    outside = [n for n in names if not isinstance(n, str) or Path(n).name != n]
    if outside:
        raise WeightLoadError(f"{index}: shard names must be files of the checkpoint directory, got {outside[:3]}")
    files = [index.parent / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightLoadError(f"{index}: shard files missing: {', '.join(missing)}")
    return files


class _TorchShard:
    """A pytorch_model*.bin shard with safe_open's interface (keys, get_tensor)."""

    def __init__(self, path: Path) -> None:
        self.state: dict[str, torch.Tensor] | None = load_torch_checkpoint(path)

    def keys(self) -> list[str]:
        assert self.state is not None
        return list(self.state)

    def get_tensor(self, name: str) -> torch.Tensor:
        assert self.state is not None
        return self.state[name]


@contextlib.contextmanager
def open_shard(path: Path) -> Iterator[Any]:
    """One shard open for reading: `keys()` and `get_tensor(name)`. Safetensors and
    memory-mapped pickles both read a tensor's bytes only when it is used."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            yield f
        return
    shard = _TorchShard(path)
    try:
        yield shard
    finally:
        shard.state = None  # unmaps the file once its tensors are dropped


def load_torch_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch checkpoint file's {name: tensor}, unpickled with weights_only (tensors
    and plain containers only: a pickle naming any other class or function is refused,
    naming the file) and memory-mapped (a pre-1.6 file, which cannot be, is read)."""
    try:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            state = torch.load(str(path), map_location="cpu", weights_only=True)  # legacy format
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f" (it references {found.group(1)})" if found else ""
        raise WeightLoadError(f"{path}: refused: this pickle holds Python objects other than tensors{what}; "
                              "pdserve loads PyTorch checkpoints with weights_only=True and never runs code "
                              "from a checkpoint (convert it to safetensors)") from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise WeightLoadError(f"{path}: cannot read this PyTorch checkpoint: {exc}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise WeightLoadError(f"{path}: expected a state dict of named tensors, got {type(state).__name__}"
                              + (" with other values" if isinstance(state, dict) else ""))
    return state


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with open_shard(path) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(factory: Callable[[], M], model_dir: Path, device: torch.device | str, dtype: torch.dtype,
                rename: Callable[[str], str | None] | None = None, random_weights: bool = False) -> M:
    """``factory()`` constructed without storage, materialised on ``device`` with its
    floating-point parameters in ``dtype`` (others keep theirs: EAGLE3's int64 ``d2t``)
    and loaded from ``model_dir`` as `load_weights` does, with the same checks.

    Every parameter is then written by the checkpoint (or reported missing: an error,
    so no uninitialised memory is ever used); the only values no checkpoint tensor
    covers, LMHead's vocabulary padding rows, are zeroed explicitly. The parameters
    come back frozen (``requires_grad`` False) and without their ``weight_loader``.

    ``random_weights`` (``--load-format dummy``) skips the checkpoint: seeded random
    matrices, unit norms, zero biases; for benchmarks at a real model's shapes."""
    with torch.device("meta"):
        model = factory()
    materialize(model, torch.device(device), dtype)
    if random_weights:
        fill_random(model)
    else:
        load_weights(model, Path(model_dir), rename=rename)
    for module in model.modules():
        if isinstance(module, LMHead):  # rows past the vocabulary (TP padding): never loaded
            module.weight.data[module.hi - module.lo:].zero_()
    # Each loader closes over its parameter (a reference cycle): kept, they would hold
    # the weights past the model's last reference until a garbage collection, so a
    # shut-down engine's device memory would not come back at once.
    for param in model.parameters():
        param.__dict__.pop("weight_loader", None)
    return model


@torch.no_grad()
def fill_random(model: nn.Module, seed: int = 0) -> None:
    """Weights for a model without a checkpoint: matrices ~ N(0, 0.02) (seeded, made
    on the device), 1-D norm weights 1 and biases 0."""
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            continue
        if param.dim() >= 2:
            gen = torch.Generator(device=param.device).manual_seed(seed + zlib.crc32(name.encode()))
            param.normal_(0.0, 0.02, generator=gen)
        else:
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """`Module.to_empty(device=...)` for a model built on the meta device, with floating
    parameters in ``dtype`` and frozen (``requires_grad`` False), keeping every
    Parameter *object*.

    Plain ``to_empty`` replaces each Parameter with a new one: its ``weight_loader``
    (whose closure holds the old, meta parameter) would be lost or, re-attached, write
    into the meta tensor, a silent no-op. Here the new storage is swapped into the
    existing objects (`torch.utils.swap_tensors`) and their attributes kept.
    Buffers are refused: nothing in the checkpoint restores them (the runner owns the
    rotary tables), so they would stay uninitialised."""
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise TypeError(f"{type(model).__name__}: buffers {buffers} cannot be materialised from a checkpoint; "
                        "keep them out of the model or initialise them in build_model")
    for name, param in model.named_parameters():  # shared parameters come once
        if not param.is_meta:
            raise TypeError(f"{type(model).__name__}.{name} was not constructed on the meta device "
                            f"(it is on {param.device}); construct parameters without an explicit device")
        # ``keeps_dtype``: a parameter that must stay as constructed (fp32 router biases).
        target = dtype if param.is_floating_point() and not getattr(param, "keeps_dtype", False) else param.dtype
        # Never trained here: with requires_grad, every forward outside inference mode
        # (a CUDA graph's capture) would record autograd state and keep it alive.
        storage = nn.Parameter(torch.empty(param.shape, dtype=target, device=device), requires_grad=False)
        attrs = dict(param.__dict__)  # weight_loader: swap_tensors swaps __dict__ too
        torch.utils.swap_tensors(param, storage)
        param.__dict__.update(attrs)


def load_weights(model: nn.Module, model_dir: Path, rename: Callable[[str], str | None] | None = None) -> None:
    """Load every parameter of `model`; raise listing missing and unexpected names.

    `rename` maps a checkpoint tensor name to the model's naming (None: skip the
    tensor); draft heads use it for their layouts. The checkpoint is streamed: one
    shard open at a time, each tensor read only if it is loaded, and released before
    the next is read."""
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
    for path in checkpoint_files(model_dir):
        with open_shard(path) as f:
            for stored_name in f.keys():
                ckpt_name = stored_name
                if ckpt_name.endswith(model.ignored_suffixes) or (tied and ckpt_name == "lm_head.weight"):
                    continue
                # Layers stored but not built (GLM-4.5's NextN layer: CausalLM.ignored_prefixes).
                if ckpt_name.startswith(getattr(model, "ignored_prefixes", ())):
                    continue
                # KV-cache scales are no weights: the runner reads them (model/kv_quant.py) when
                # the KV pool is fp8. A model that does not say it reads them refuses them below.
                if getattr(model, "reads_kv_scales", False) and is_kv_scale_name(ckpt_name):
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
                tensor = f.get_tensor(stored_name)  # the only checkpoint tensor on the host
                try:
                    param.weight_loader(tensor, shard)  # type: ignore[attr-defined]
                except WeightShapeError as exc:
                    raise WeightShapeError(f"{model_dir}: {ckpt_name}: {exc}") from None
                seen.add((target, shard))
                if tied and ckpt_name == "model.embed_tokens.weight":
                    params["lm_head.weight"].weight_loader(tensor, None)  # type: ignore[attr-defined]
                del tensor
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


def _map_name(model: nn.Module, ckpt_name: str) -> tuple[str, object]:
    for ours, theirs, shard in model.stacked_params:
        if f".{theirs}." in ckpt_name:
            return ckpt_name.replace(f".{theirs}.", f".{ours}."), shard
    return ckpt_name, None
