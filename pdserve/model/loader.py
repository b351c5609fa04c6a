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

FP8 checkpoints (config.json ``quantization_config``, model_config.Fp8Config): every
scale tensor is read first (small: 1/16384 of its weight's elements in 128x128
blocks, 1/in per channel), so a weight finds its scale wherever the two are stored.
An fp8 weight is then either dequantised on the host to fp32 and loaded as any other
tensor (CPU, GPUs without FP8 tensor cores, layers without an FP8 path: embeddings,
the LM head), or copied as it is, with its scales, into a linear or an MoE block's
fused expert matrices that `keep_fp8` switched to the FP8 GEMM (CUDA with compute
capability >= 8.9).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import pickle
import re
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from pdserve.model.fp8 import FP8_DTYPE, Fp8ScaleError, dequantize, gemm_scale
from pdserve.model.kv_quant import is_kv_scale_name
from pdserve.model.layers import LMHead, Linear, WeightShapeError
from pdserve.model.model_config import Fp8Config
from pdserve.model.moe import ExpertStack

M = TypeVar("M", bound=nn.Module)
logger = logging.getLogger(__name__)


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
                rename: Callable[[str], str | None] | None = None, random_weights: bool = False,
                fp8_weights: bool | None = None) -> M:
    """``factory()`` constructed without storage, materialised on ``device`` with its
    floating-point parameters in ``dtype`` (others keep theirs: EAGLE3's int64 ``d2t``)
    and loaded from ``model_dir`` as `load_weights` does, with the same checks.

    Every parameter is then written by the checkpoint (or reported missing: an error,
    so no uninitialised memory is ever used); the only values no checkpoint tensor
    covers, LMHead's vocabulary padding rows, are zeroed explicitly. The parameters
    come back frozen (``requires_grad`` False) and without their ``weight_loader``.

    ``random_weights`` (``--load-format dummy``) skips the checkpoint: seeded random
    matrices, unit norms, zero biases; for benchmarks at a real model's shapes.

    An FP8 checkpoint's linears keep their fp8 weights (the FP8 GEMM) when
    ``fp8_weights`` says so, by default where `fp8_gemm_available` (CUDA, compute
    capability >= 8.9); otherwise every fp8 weight is dequantised to ``dtype``. True on
    a CPU is for tests: the kernels then run under Triton's interpreter."""
    device = torch.device(device)
    with torch.device("meta"):
        model = factory()
    quant: Fp8Config | None = getattr(model.config, "quant", None)
    scales: dict[str, torch.Tensor] = {}
    if quant is not None and not random_weights:
        scales = read_weight_scales(Path(model_dir), quant)
        if rename is None and (fp8_available(device) if fp8_weights is None else fp8_weights):
            keep_fp8_layers(model, quant, scales)
    materialize(model, device, dtype)
    if random_weights:
        fill_random(model)
    else:
        load_weights(model, Path(model_dir), rename=rename, scales=scales)
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
        # Others keep theirs: int64 ``d2t``, an FP8 layer's float8 weight and fp32 scales, and
        # ``keep_dtype`` parameters that must stay as constructed (fp32 router biases).
        keep = not param.is_floating_point() or getattr(param, "keep_dtype", False)
        target = param.dtype if keep else dtype
        # Never trained here: with requires_grad, every forward outside inference mode
        # (a CUDA graph's capture) would record autograd state and keep it alive.
        storage = nn.Parameter(torch.empty(param.shape, dtype=target, device=device), requires_grad=False)
        attrs = dict(param.__dict__)  # weight_loader: swap_tensors swaps __dict__ too
        torch.utils.swap_tensors(param, storage)
        param.__dict__.update(attrs)


def fp8_available(device: torch.device) -> bool:
    """Whether FP8 layers run on ``device``: the FP8 GEMM (Triton) needs float8 e4m3
    tensor cores, CUDA compute capability >= 8.9 (Ada, Hopper and later)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scale_name(weight_name: str, quant: Fp8Config) -> str:
    """``x.weight`` -> ``x.weight_scale_inv`` (quant_method fp8) or ``x.weight_scale``."""
    return weight_name.removesuffix("weight") + quant.scale_suffix


def read_weight_scales(model_dir: Path, quant: Fp8Config) -> dict[str, torch.Tensor]:
    """The checkpoint's FP8 weight scales by the stored name of their weight, from every
    shard (a weight and its scale may be in different files, in either order)."""
    suffix = "." + quant.scale_suffix
    scales: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with open_shard(path) as f:
            for name in f.keys():
                if name.endswith(suffix):
                    scales[name.removesuffix(quant.scale_suffix) + "weight"] = f.get_tensor(name)
    return scales


def _expected_names(model: nn.Module, tied: bool) -> dict[tuple[str, object], str]:
    """(our parameter name, shard) -> the checkpoint tensor that fills it (FP8 scales
    excepted: they are loaded with their weight)."""
    expected: dict[tuple[str, object], str] = {}
    for name, param in model.named_parameters():
        if (tied and name == "lm_head.weight") or getattr(param, "fp8_scale", False):
            continue
        shards = [(theirs, shard) for ours, theirs, shard in model.stacked_params if f".{ours}." in name]
        for theirs, shard in shards:
            ours = next(o for o, t, _ in model.stacked_params if t == theirs)
            expected[(name, shard)] = name.replace(f".{ours}.", f".{theirs}.")
        if not shards:
            expected[(name, None)] = name
    return expected


def keep_fp8_layers(model: nn.Module, quant: Fp8Config, scales: dict[str, torch.Tensor]) -> None:
    """Switch to fp8 weights (Linear.keep_fp8, moe.ExpertStack.keep_fp8) each linear and
    each fused expert matrix of the meta-device ``model`` whose every checkpoint part is
    stored in fp8 (has a scale). The LM head and embeddings keep float weights:
    checkpoints leave them unquantised."""
    group = quant.group
    if group < 16 or group & (group - 1):
        logger.warning("FP8 weight blocks %d columns wide: the FP8 GEMM needs a power of two of at least 16; "
                       "the fp8 weights are dequantised instead", group)
        return
    parts: dict[str, list[str]] = {}
    for (name, _), ckpt in _expected_names(model, tied=False).items():
        parts.setdefault(name, []).append(ckpt)
    varies = quant.strategy == "block"
    for module_name, module in model.named_modules():
        if not isinstance(module, (Linear, ExpertStack)) or isinstance(module, LMHead):
            continue
        ckpt_names = parts.get(f"{module_name}.weight", [])
        if ckpt_names and all(n in scales for n in ckpt_names):
            if isinstance(module, ExpertStack):  # every expert's matrix at once (MoE gate_up / down)
                module.keep_fp8(group, scale_varies_along_input=varies, where=module_name)
            else:
                module.keep_fp8(group, scale_varies_along_input=varies)


def load_weights(model: nn.Module, model_dir: Path, rename: Callable[[str], str | None] | None = None,
                 scales: dict[str, torch.Tensor] | None = None) -> None:
    """Load every parameter of `model`; raise listing missing and unexpected names.

    `rename` maps a checkpoint tensor name to the model's naming (None: skip the
    tensor); draft heads use it for their layouts. The checkpoint is streamed: one
    shard open at a time, each tensor read only if it is loaded, and released before
    the next is read. An FP8 checkpoint's scales (`read_weight_scales`, read here
    unless given) go with their weights: into the layer's scales where it kept fp8
    weights, else into the dequantisation of the weight."""
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    quant: Fp8Config | None = getattr(model.config, "quant", None)
    if quant is not None and scales is None:
        scales = read_weight_scales(model_dir, quant)
    scales = dict(scales or {})  # what is left at the end belongs to no loaded weight
    # (our parameter name, shard) -> checkpoint name, for the missing-name report.
    expected = _expected_names(model, tied)
    seen: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    stats = _Fp8Stats()
    for path in checkpoint_files(model_dir):
        with open_shard(path) as f:
            for stored_name in f.keys():
                ckpt_name = stored_name
                if ckpt_name.endswith(model.ignored_suffixes) or (tied and ckpt_name == "lm_head.weight"):
                    continue
                # Layers stored but not built (GLM-4.5's NextN layer: CausalLM.ignored_prefixes);
                # a skipped fp8 weight's scale goes with it.
                if ckpt_name.startswith(getattr(model, "ignored_prefixes", ())):
                    scales.pop(stored_name, None)
                    continue
                if quant is not None and ckpt_name.endswith("." + quant.scale_suffix):
                    continue  # read by read_weight_scales, loaded with its weight
                # KV-cache scales are no weights: the runner reads them (model/kv_quant.py) when
                # the KV pool is fp8. A model that does not say it reads them refuses them below.
                if getattr(model, "reads_kv_scales", False) and is_kv_scale_name(ckpt_name):
                    continue
                if rename is not None:
                    renamed = rename(ckpt_name)
                    if renamed is None:
                        scales.pop(stored_name, None)
                        continue
                    ckpt_name = renamed
                target, shard = _map_name(model, ckpt_name)
                param = params.get(target)
                if param is None or (target, shard) not in expected:
                    unexpected.append(ckpt_name)
                    continue
                tensor = f.get_tensor(stored_name)  # the only checkpoint tensor on the host
                scale = scales.pop(stored_name, None)
                try:
                    if scale is None and tensor.dtype.itemsize == 1 and tensor.is_floating_point():
                        raise WeightLoadError(
                            f"{model_dir}: {stored_name} is stored as {tensor.dtype}, but "
                            + (f"the checkpoint has no {scale_name(stored_name, quant)}" if quant is not None
                               else "config.json has no quantization_config saying how to dequantise it"))
                    if scale is not None:
                        assert quant is not None
                        tensor = _load_fp8(model_dir, stored_name, tensor, scale, quant, params, target, shard,
                                           stats)
                    if tensor is not None:
                        param.weight_loader(tensor, shard)  # type: ignore[attr-defined]
                except (WeightShapeError, Fp8ScaleError) as exc:
                    raise WeightShapeError(f"{model_dir}: {ckpt_name}: {exc}") from None
                seen.add((target, shard))
                if tied and ckpt_name == "model.embed_tokens.weight":
                    params["lm_head.weight"].weight_loader(tensor, None)  # type: ignore[attr-defined]
                del tensor
    unexpected += [scale_name(name, quant) for name in scales if quant is not None]
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
    if quant is not None:
        stats.log(model_dir, quant, params)


class _Fp8Stats:
    """What an FP8 checkpoint's load read and left resident (the log line)."""

    def __init__(self) -> None:
        self.read_bytes = 0                       # fp8 weights + their scales, as stored
        self.dequantised: dict[str, nn.Parameter] = {}
        self.kept: dict[str, nn.Parameter] = {}   # fp8 weights and their scales

    def log(self, model_dir: Path, quant: Fp8Config, params: dict[str, nn.Parameter]) -> None:
        mib = 1 << 20
        deq = sum(p.nbytes for p in self.dequantised.values())
        kept = sum(p.nbytes for p in self.kept.values())
        dtype = next(iter(self.dequantised.values())).dtype if self.dequantised else None
        logger.info("%s: FP8 checkpoint (%s, %s scales): read %.2f MiB of fp8 weights and scales; "
                    "resident on this rank: %.2f MiB dequantised to %s (%d parameters), %.2f MiB kept in fp8 "
                    "with scales (%d parameters)", model_dir.name, quant.method, quant.strategy,
                    self.read_bytes / mib, deq / mib, dtype, len(self.dequantised), kept / mib, len(self.kept))


def _load_fp8(model_dir: Path, stored_name: str, weight: torch.Tensor, scale: torch.Tensor, quant: Fp8Config,
              params: dict[str, nn.Parameter], target: str, shard: object, stats: _Fp8Stats) -> torch.Tensor | None:
    """An fp8 weight and its scale: loaded as they are into a layer that kept fp8 weights
    (None returned: nothing left to load), else dequantised to fp32 (returned)."""
    if weight.dtype != FP8_DTYPE:
        raise WeightLoadError(f"{model_dir}: {stored_name} has a scale ({scale_name(stored_name, quant)}) but "
                              f"is stored as {weight.dtype}, not float8_e4m3fn")
    module = stored_name.removesuffix(".weight")
    if quant.ignores(module):
        raise WeightLoadError(f"{model_dir}: {stored_name} is stored in fp8, but quantization_config's ignore "
                              f"list {list(quant.ignore)} names {module} as not quantised")
    if weight.dim() != 2:
        raise WeightLoadError(f"{model_dir}: {stored_name}: an fp8 weight must be a matrix, got shape "
                              f"{tuple(weight.shape)}")
    stats.read_bytes += weight.nbytes + scale.nbytes
    param = params[target]
    if param.dtype == FP8_DTYPE:
        scale_param = target.removesuffix("weight") + "weight_scale"
        param.weight_loader(weight, shard)  # type: ignore[attr-defined]
        params[scale_param].weight_loader(  # type: ignore[attr-defined]
            gemm_scale(scale, tuple(weight.shape), quant, scale_name(stored_name, quant)), shard)
        stats.kept[target] = param
        stats.kept[scale_param] = params[scale_param]
        return None
    stats.dequantised[target] = param
    return dequantize(weight, scale, quant, scale_name(stored_name, quant))


def _map_name(model: nn.Module, ckpt_name: str) -> tuple[str, object]:
    for ours, theirs, shard in model.stacked_params:
        if f".{theirs}." in ckpt_name:
            return ckpt_name.replace(f".{theirs}.", f".{ours}."), shard
    return ckpt_name, None
