"""Block-scaled FP8 GEMM in Triton: y = x W^T for a float8_e4m3fn weight W [N, K] with fp32
scales per output row and per ``group`` input columns ([N, ceil(K / group)], see
model/fp8.py `gemm_scale`), and activations quantised at run time the way DeepSeek-V3
runs its FP8 checkpoints: per token, per ``group`` columns, scale = max|x| / 448.

Two kernels: `quantize_activations` writes x as fp8 plus its [M, ceil(K / group)] scales;
`fp8_matmul` walks K one group at a time, takes the fp8 x fp8 dot of each [BLOCK_M,
group] x [group, BLOCK_N] tile pair and adds it to an fp32 accumulator times the row's
activation scale and the column's weight scale (each group's partial product is
promoted to fp32 before the next, as DeepSeek-V3 does to keep the tensor cores' reduced
accumulation precision out of the sum).

Under Triton's interpreter (CPU tests) two of its numpy emulations are wrong for fp8:
a dot of fp8 operands multiplies their raw bytes, and the fp32 -> e4m3 cast neither
rounds to nearest even nor carries into the exponent. So rounding is done in fp32 by
`_round_e4m3` on every device (the cast then only converts exactly representable
values), and under the interpreter the dot's operands are widened to fp32 first, which
gives the same products (fp8 x fp8 is exact in fp32). On a GPU the dot is the fp8 one
(tensor cores, compute capability >= 8.9). Not run on a GPU so far.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdserve.model.fp8 import ACT_EPS, FP8_DTYPE, FP8_MAX


@triton.jit
def _round_e4m3(x):
    """``x`` (fp32, |x| <= 448) rounded to nearest even on the float8 e4m3 grid, in fp32:
    the grid step is 2^(exponent - 3) for normal values and 2^-9 below 2^-6; adding and
    subtracting 1.5 * 2^23 rounds x / step to an integer in the current (nearest even) mode."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    y = x / step  # a power of two: exact
    return ((y + 12582912.0) - 12582912.0) * step


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, GROUPS, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                     FMAX: tl.constexpr, EPS: tl.constexpr):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), EPS)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32))  # correctly rounded, as torch divides
    q = tl.math.div_rn(x, scale[:, None])
    q = _round_e4m3(tl.minimum(tl.maximum(q, -FMAX), FMAX))
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + rows * GROUPS + g, scale, mask=rows < M)


@triton.jit
def _fp8_matmul_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, GROUPS, stride_bn, stride_cm,
                       GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       WIDEN_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, GROUP)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, GROUPS):
        k = g * GROUP + rk
        k_ok = k < K
        a = tl.load(a_ptr + rm[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rn[None, :] * stride_bn + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptr + rm * GROUPS + g, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptr + rn * GROUPS + g, mask=n_ok, other=0.0)
        if WIDEN_DOT:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            part = tl.dot(a, b)
        acc += part * a_s[:, None] * b_s[None, :]
    c_mask = m_ok[:, None] & n_ok[None, :]
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _check_group(group: int) -> None:
    # tl.arange needs a power of two; tl.dot a reduction dimension of at least 16.
    if group < 16 or group & (group - 1):
        raise ValueError(f"the FP8 GEMM needs a power-of-two group of at least 16 columns, got {group}")


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(max(n, 1))))


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scales fp32 [M, ceil(K / group)]), as model/fp8.py
    `quantize_activations` computes them."""
    _check_group(group)
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        block_m = _block(m, 16)
        _quantize_kernel[(triton.cdiv(m, block_m), groups)](
            x, q, s, m, k, x.stride(0), groups, GROUP=group, BLOCK_M=block_m, FMAX=FP8_MAX, EPS=ACT_EPS)
    return q, s


def fp8_matmul(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
               out_dtype: torch.dtype) -> torch.Tensor:
    """(xq * xs) @ (weight * weight_scale)^T [M, N] in ``out_dtype``, accumulated in fp32."""
    _check_group(group)
    m, k = xq.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != FP8_DTYPE or weight.stride(-1) != 1:
        raise ValueError(f"fp8_matmul: weight must be a row-major float8_e4m3fn [N, {k}], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    groups = triton.cdiv(k, group)
    if tuple(weight_scale.shape) != (n, groups) or tuple(xs.shape) != (m, groups):
        raise ValueError(f"fp8_matmul: scales must be [{n}, {groups}] and [{m}, {groups}], got "
                         f"{tuple(weight_scale.shape)} and {tuple(xs.shape)}")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m and n:
        block_m, block_n = _block(m, 64), _block(n, 128)
        widen = os.environ.get("TRITON_INTERPRET") == "1"  # see the module docstring
        _fp8_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            xq, xs, weight, weight_scale.contiguous(), out, m, n, k, groups, weight.stride(0), out.stride(0),
            GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, WIDEN_DOT=widen)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer over an fp8 weight: x [..., K] (any float dtype) -> [..., N] in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_activations(x2, group)
    out = fp8_matmul(xq, xs, weight, weight_scale, group, x.dtype)
    if bias is not None:
        out += bias
    return out.reshape(*lead, weight.shape[0])
