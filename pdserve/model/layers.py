"""Shared building blocks: norms, rotary embedding and tensor-parallel linears.

Every parameter carries a `weight_loader(tensor, shard)` that checks the
checkpoint tensor's full (unsharded) shape and copies this rank's slice.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.model_config import RopeConfig
from pdserve.model.parallel import TPGroup, shard_range


class WeightShapeError(ValueError):
    pass


def _attach_loader(param: nn.Parameter, loader: Callable[[torch.Tensor, object], None]) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def _check_shape(loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise WeightShapeError(f"{what}: checkpoint shape {tuple(loaded.shape)}, "
                               f"model expects {tuple(expected)}")


PREPACK_MIN_WEIGHTS = 1 << 20


def cpu_prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-packed copy of a linear weight for CPU inference, or None where that
    path is unavailable or slower. Measured on one core: with >= 1M weights and
    more than one input row it is 1.2-2x faster than F.linear (2x for 8 decode
    rows); below ~0.5M weights, or for a single row, F.linear is as fast or up
    to 2x faster (its call costs less). A numerical self-check guards the switch."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.numel() < PREPACK_MIN_WEIGHTS:
        return None
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        want = F.linear(probe, weight)
    except (AttributeError, RuntimeError):
        return None
    scale = float(want.abs().max()) + 1e-6
    return packed if float((got - want).abs().max()) <= 1e-5 * scale else None


def keep_fp8_weight(weight: nn.Parameter, group: int, scale_varies_along_input: bool, input_start: int,
                    what: str) -> nn.Parameter:
    """Switch the meta-device ``weight`` [..., rows, cols] in place to float8_e4m3fn
    (its attributes, the weight_loader among them, kept) and return its new fp32 scales
    parameter [..., rows, ceil(cols / group)] (no loader yet): the layout the FP8 GEMM
    reads (model/fp8.py `gemm_scale`). Refused, naming ``what``: a ``group`` the GEMM
    cannot run, and a TP shard whose input columns start at ``input_start`` inside a
    block of scales that vary along the input (block layouts): its activation groups
    would straddle two weight scales."""
    if group < 16 or group & (group - 1):
        raise WeightShapeError(f"{what}: FP8 weight blocks {group} columns wide: the FP8 GEMM needs a "
                               "power of two of at least 16")
    if scale_varies_along_input and input_start % group:
        raise WeightShapeError(
            f"{what}: this TP rank's input columns start at {input_start}, inside a {group}-column "
            f"block of the FP8 weight scales: --tp-size must split {what}'s input at multiples of {group}")
    *lead, rows, cols = weight.shape
    fp8 = nn.Parameter(torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device),
                       requires_grad=False)
    attrs = dict(weight.__dict__)  # its weight_loader (swap_tensors swaps __dict__ too)
    torch.utils.swap_tensors(weight, fp8)
    weight.__dict__.update(attrs, keep_dtype=True)  # materialize keeps float8
    scale = nn.Parameter(torch.empty(*lead, rows, -(-cols // group), device=weight.device), requires_grad=False)
    scale.keep_dtype = True  # type: ignore[attr-defined]  # fp32 whatever the model dtype
    scale.fp8_scale = True  # type: ignore[attr-defined]  # loaded with its weight
    return scale


class Linear(nn.Module):
    """Base of the linears: y = x W^T + b, through the packed CPU kernel when prepacked,
    or through the block-scaled FP8 GEMM when `keep_fp8` made the weight float8."""

    weight: nn.Parameter
    what: str
    _packed: torch.Tensor | None = None
    # FP8 weights (`keep_fp8`): input columns per scale (0: the weight is a float one) and
    # the fp32 scales [rows, ceil(in / fp8_group)].
    fp8_group: int = 0
    weight_scale: nn.Parameter  # registered by keep_fp8 only
    # The first checkpoint input column of this rank's weight (RowParallelLinear shards it).
    input_start: int = 0

    def prepack(self) -> None:
        self._packed = cpu_prepack(self.weight.data)

    def keep_fp8(self, group: int, scale_varies_along_input: bool) -> None:
        """Hold the weight as the checkpoint's float8_e4m3fn values plus fp32 scales per
        output row and per ``group`` input columns (model/fp8.py `gemm_scale`); forward
        then runs model/fp8_gemm.py. Called on the meta-device module, before its storage
        is made (loader.build_model). A TP shard whose input starts inside a block of
        scales that vary along the input (block layouts) is refused, naming the layer."""
        self.weight_scale = keep_fp8_weight(self.weight, group, scale_varies_along_input, self.input_start,
                                            self.what)
        _attach_loader(self.weight_scale, self._scale_loader(self.weight_scale))
        self.fp8_group = group

    def _scale_loader(self, param: nn.Parameter) -> Callable[[torch.Tensor, object], None]:
        raise NotImplementedError(f"{type(self).__name__} has no FP8 weight format")

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8_group:
            from pdserve.model.fp8_gemm import fp8_linear  # Triton: imported only where weights are fp8

            return fp8_linear(x, self.weight, self.weight_scale, self.fp8_group, bias)
        if (self._packed is not None and x.dtype == torch.float32 and x.device.type == "cpu"
                and x.numel() > x.shape[-1]):  # one row: F.linear is faster
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


def _full_loader(param: nn.Parameter, what: str) -> Callable[[torch.Tensor, object], None]:
    def load(loaded: torch.Tensor, shard: object = None) -> None:
        _check_shape(loaded, tuple(param.shape), what)
        param.data.copy_(loaded)
    return load


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        _attach_loader(self.weight, _full_loader(self.weight, "norm weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32, as Hugging Face does, whatever the activation dtype.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        mid = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, head_dim, rope)
    return inv_freq.float()


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN (NTK-by-parts): frequency pairs that turn fewer than ``beta_slow`` times over
    the pretraining length are interpolated (divided by ``factor``), those turning more
    than ``beta_fast`` times are kept, and a linear ramp over the pair index blends the
    ones between. The cos/sin scaling is `RotaryEmbedding`'s (rope.attention_factor)."""
    def pair_index(rotations: float) -> float:
        # The (fractional) pair index whose frequency turns `rotations` times over the original length.
        return (head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = pair_index(rope.beta_fast), pair_index(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    # ramp 0: keep (extrapolate) the frequency; ramp 1: interpolate it.
    return inv_freq * (1 - ramp) + (inv_freq / rope.factor) * ramp


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE with a precomputed cos/sin table (times
    yarn's attention factor, as transformers applies it). With a partial rotary factor
    (GLM-4.5) the rotate-half layout covers the first ``rotary_dim`` dims of each head
    (pairs i and i + rotary_dim / 2), and the rest pass through unchanged."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.rotary_dim = rope.rotary_dim(head_dim)
        inv_freq = rope_inv_freq(self.rotary_dim, rope)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # yarn scales both q and k (so the attention logits by its square); 1 otherwise.
        scale = rope.attention_factor
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, rotary_dim/2] at ``positions`` [T]."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k: [T, heads, head_dim] rotated by ``cos_sin()`` of their positions."""
        cos, sin = cos_sin
        if self.rotary_dim == q.shape[-1]:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        d = self.rotary_dim
        return (torch.cat((_rotate(q[..., :d], cos, sin), q[..., d:]), dim=-1),
                torch.cat((_rotate(k[..., :d], cos, sin), k[..., d:]), dim=-1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class ColumnParallelLinear(Linear):
    """A linear whose output rows are sharded over TP ranks; `out_shards` fuses
    several checkpoint matrices (e.g. gate and up) into one matmul."""

    def __init__(self, in_features: int, out_shards: dict[object, int], bias: bool, tp: TPGroup,
                 what: str) -> None:
        super().__init__()
        self.tp = tp
        self.what = what
        self.full = dict(out_shards)
        self.local = {k: shard_range(v, tp.rank, tp.size, f"{what} output size")
                      for k, v in out_shards.items()}
        self.offsets: dict[object, int] = {}
        total = 0
        for key, (lo, hi) in self.local.items():
            self.offsets[key] = total
            total += hi - lo
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(total, in_features))
        self.bias = nn.Parameter(torch.zeros(total)) if bias else None
        _attach_loader(self.weight, self._loader(self.weight))
        if self.bias is not None:
            _attach_loader(self.bias, self._loader(self.bias))

    def _loader(self, param: nn.Parameter) -> Callable[[torch.Tensor, object], None]:
        def load(loaded: torch.Tensor, shard: object = None) -> None:
            key = shard if shard is not None else next(iter(self.full))
            expected = (self.full[key],) + tuple(param.shape[1:])
            _check_shape(loaded, expected, f"{self.what}[{key}]")
            lo, hi = self.local[key]
            off = self.offsets[key]
            param.data[off: off + hi - lo].copy_(loaded[lo:hi])
        return load

    def _scale_loader(self, param: nn.Parameter) -> Callable[[torch.Tensor, object], None]:
        # The FP8 scales [rows, groups] have a row per weight row: sliced like the weight.
        return self._loader(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. KV heads are sharded when there are at least as
    many as ranks, and replicated (each rank keeps the one its q heads use) otherwise."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPGroup) -> None:
        if num_heads % tp.size:
            raise ValueError(f"num_attention_heads ({num_heads}) is not divisible by --tp-size {tp.size}")
        if num_kv_heads >= tp.size:
            if num_kv_heads % tp.size:
                raise ValueError(f"num_key_value_heads ({num_kv_heads}) is not divisible by "
                                 f"--tp-size {tp.size}")
            kv_local, kv_start = num_kv_heads // tp.size, tp.rank * (num_kv_heads // tp.size)
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"--tp-size {tp.size} is not a multiple of num_key_value_heads "
                                 f"({num_kv_heads})")
            kv_local, kv_start = 1, tp.rank // (tp.size // num_kv_heads)
        self.num_local_heads = num_heads // tp.size
        self.num_local_kv_heads = kv_local
        self.head_dim = head_dim
        super().__init__(hidden, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                  "v": num_kv_heads * head_dim}, bias, TPGroup(), "qkv_proj")
        # Replace the even split with the head-aware one computed above.
        self.tp = tp
        self.local = {
            "q": (tp.rank * self.num_local_heads * head_dim, (tp.rank + 1) * self.num_local_heads * head_dim),
            "k": (kv_start * head_dim, (kv_start + kv_local) * head_dim),
            "v": (kv_start * head_dim, (kv_start + kv_local) * head_dim),
        }
        q_size = self.num_local_heads * head_dim
        kv_size = kv_local * head_dim
        self.offsets = {"q": 0, "k": q_size, "v": q_size + kv_size}
        self.split_sizes = (q_size, kv_size, kv_size)
        self.weight = nn.Parameter(torch.empty(q_size + 2 * kv_size, hidden))
        _attach_loader(self.weight, self._loader(self.weight))
        if bias:
            self.bias = nn.Parameter(torch.zeros(q_size + 2 * kv_size))
            _attach_loader(self.bias, self._loader(self.bias))


class RowParallelLinear(Linear):
    """A linear whose input columns are sharded; outputs are summed over ranks (unless
    ``reduce_results`` is False: then the caller all-reduces this rank's partial sum,
    with others, once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, what: str,
                 reduce_results: bool = True) -> None:
        super().__init__()
        if bias and not reduce_results:
            # Every rank would add the bias to its partial sum: the reduction would count it tp times.
            raise ValueError(f"{what}: a bias needs the output reduced here")
        self.tp = tp
        self.what = what
        self.reduce_results = reduce_results
        self.lo, self.hi = shard_range(in_features, tp.rank, tp.size, f"{what} input size")
        self.input_start = self.lo
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.hi - self.lo))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

        def load_weight(loaded: torch.Tensor, shard: object = None) -> None:
            _check_shape(loaded, (out_features, in_features), what)
            self.weight.data.copy_(loaded[:, self.lo:self.hi])
        _attach_loader(self.weight, load_weight)
        if self.bias is not None:
            _attach_loader(self.bias, _full_loader(self.bias, f"{what} bias"))

    def _scale_loader(self, param: nn.Parameter) -> Callable[[torch.Tensor, object], None]:
        # [out, ceil(in / group)]: this rank's input columns start at a group boundary
        # (keep_fp8 checks it where the scales vary along the input).
        def load(loaded: torch.Tensor, shard: object = None) -> None:
            group = self.fp8_group
            _check_shape(loaded, (self.out_features, -(-self.in_features // group)), f"{self.what} weight scale")
            first = self.lo // group
            param.data.copy_(loaded[:, first:first + param.shape[1]])
        return load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x, None)
        if not self.reduce_results:
            return out
        out = self.tp.all_reduce(out)
        return out + self.bias if self.bias is not None else out


class Embedding(nn.Module):
    """Token embedding, replicated on every rank (cheap next to the layers)."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden))
        _attach_loader(self.weight, _full_loader(self.weight, "embed_tokens"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(Linear):
    """Vocabulary-parallel output projection; the vocab is padded to a multiple of
    the TP size and the padding sliced off after the gather."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        per = -(-vocab_size // tp.size)
        self.lo = min(tp.rank * per, vocab_size)
        self.hi = min((tp.rank + 1) * per, vocab_size)
        self.weight = nn.Parameter(torch.zeros(per, hidden))

        def load(loaded: torch.Tensor, shard: object = None) -> None:
            _check_shape(loaded, (vocab_size, hidden), "lm_head")
            self.weight.data.zero_()
            self.weight.data[: self.hi - self.lo].copy_(loaded[self.lo:self.hi])
        _attach_loader(self.weight, load)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._matmul(hidden, None)
        if self.tp.enabled:
            logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
