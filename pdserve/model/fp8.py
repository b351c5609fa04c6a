"""FP8 checkpoint weights (model_config.Fp8Config) in torch: dequantisation (the CPU path
and the reference), the scale layout the FP8 GEMM reads, the activation quantiser the
GEMM implements, and the quantisers that write FP8 checkpoints (pdserve.testing).

Layouts (W = W_fp8 * scale broadcast over its block):
- block (quant_method fp8 ``weight_scale_inv``; compressed-tensors ``block``): scale
  [ceil(out / block_n), ceil(in / block_k)], the last block row / column may be partial;
- channel (compressed-tensors): scale [out, 1];
- tensor (compressed-tensors): one scale (shape [] or [1]).

The GEMM (model/fp8_gemm.py) reads every layout as one fp32 scale per output row and per
``group`` input columns, [out, ceil(in / group)] (`gemm_scale`): per-row scales let a TP
column shard or a fused q/k/v part start at any row, and cost 1/(group / 4) of the fp8
bytes (1/32 at 128).
"""

from __future__ import annotations

import torch

from pdserve.model.model_config import Fp8Config

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest activation group max a scale is computed from: an all-zero group
# quantises to zeros instead of dividing by zero.
ACT_EPS = 1e-10


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8ScaleError(ValueError):
    pass


def gemm_scale(scale: torch.Tensor, shape: tuple[int, ...], quant: Fp8Config, what: str) -> torch.Tensor:
    """The checkpoint scale of a weight of ``shape`` [out, in] as fp32 [out, ceil(in / group)]
    (one per output row and per ``quant.group`` input columns); its shape is checked
    against the layout, naming ``what``."""
    rows, cols = shape
    scale = scale.to(torch.float32)
    groups = _cdiv(cols, quant.group)
    if quant.strategy == "block":
        assert quant.block is not None
        bn, bk = quant.block
        grid = (_cdiv(rows, bn), _cdiv(cols, bk))
        if tuple(scale.shape) != grid:
            raise Fp8ScaleError(f"{what}: scale shape {tuple(scale.shape)}, expected {grid} for a weight "
                                f"{tuple(shape)} in {bn}x{bk} blocks")
        return scale.repeat_interleave(bn, dim=0)[:rows].contiguous()  # group == bk: one column per block
    if quant.strategy == "channel":
        if tuple(scale.shape) not in ((rows, 1), (rows,)):
            raise Fp8ScaleError(f"{what}: scale shape {tuple(scale.shape)}, expected ({rows}, 1) (one per "
                                "output channel)")
        return scale.reshape(rows, 1).expand(rows, groups).contiguous()
    if scale.numel() != 1:
        raise Fp8ScaleError(f"{what}: scale shape {tuple(scale.shape)}, expected one value (strategy tensor)")
    return scale.reshape(1, 1).expand(rows, groups).contiguous()


def dequantize(weight: torch.Tensor, scale: torch.Tensor, quant: Fp8Config, what: str = "weight") -> torch.Tensor:
    """W_fp8 * scale in fp32 (what the CPU path loads and what the GEMM is checked against)."""
    if weight.dtype != FP8_DTYPE:
        raise Fp8ScaleError(f"{what}: a weight with a scale must be stored as float8_e4m3fn, got {weight.dtype}")
    rows, cols = weight.shape
    per_col = gemm_scale(scale, (rows, cols), quant, what).repeat_interleave(quant.group, dim=1)[:, :cols]
    return weight.to(torch.float32) * per_col


def quantize_weight(weight: torch.Tensor, quant: Fp8Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_fp8, scale) of a float weight in ``quant``'s layout, as checkpoints are written:
    block scales as transformers' FineGrainedFP8 quantiser computes them (448 / block max,
    stored inverted; zero blocks get scale 1; partial edge blocks are padded), channel and
    tensor scales as compressed-tensors does (max / 448, W / scale)."""
    w = weight.to(torch.float32)
    rows, cols = w.shape
    if quant.strategy == "block":
        assert quant.block is not None
        bn, bk = quant.block
        padded = torch.nn.functional.pad(w, (0, _cdiv(cols, bk) * bk - cols, 0, _cdiv(rows, bn) * bn - rows))
        tiles = padded.reshape(_cdiv(rows, bn), bn, _cdiv(cols, bk), bk)
        amax = tiles.abs().amax(dim=(1, 3))
        mult = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, 1.0), 1.0)
        q = (tiles * mult[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        q = q.reshape(padded.shape)[:rows, :cols].contiguous()
        return q, (1.0 / mult).to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True) if quant.strategy == "channel" else w.abs().amax().reshape(1)
    scale = torch.where(amax > 0, amax, 1.0) / FP8_MAX
    q = (w / (scale if quant.strategy == "channel" else scale[0])).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.to(torch.float32)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's dynamic activation scheme, the reference of the GEMM's quantiser: per
    row and per ``group`` columns (the last group may be partial), scale = max|x| / 448
    (at least ACT_EPS / 448), x_fp8 = x / scale rounded to nearest even. Returns
    (x_fp8 [M, K], scales fp32 [M, ceil(K / group)])."""
    m, k = x.shape
    xf = x.to(torch.float32)
    groups = _cdiv(k, group)
    padded = torch.nn.functional.pad(xf, (0, groups * group - k)).reshape(m, groups, group)
    scale = padded.abs().amax(dim=-1).clamp(min=ACT_EPS) / FP8_MAX
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(m, groups * group)[:, :k].contiguous(), scale


def reference_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """What the FP8 GEMM computes, in fp32 torch: x quantised as `quantize_activations`,
    times the fp8 weight [N, K] with its [N, ceil(K / group)] scales."""
    xq, xs = quantize_activations(x, group)
    k = x.shape[1]
    a = xq.to(torch.float32) * xs.repeat_interleave(group, dim=1)[:, :k]
    w = weight.to(torch.float32) * scale.repeat_interleave(group, dim=1)[:, :k]
    return a @ w.T
