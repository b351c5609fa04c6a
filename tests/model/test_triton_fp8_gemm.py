"""The block-scaled FP8 GEMM (model/fp8_gemm.py) against its torch reference (model/fp8.py):
the activation quantiser gives the reference's fp8 values and scales exactly, the GEMM its
fp32 result up to summation order, and the layers of an FP8 checkpoint built with fp8
weights (the CUDA path, TP-sharded) compute what the dequantised checkpoint computes up
to the activations' fp8 rounding. Without a GPU the kernels run under Triton's
interpreter (conftest sets TRITON_INTERPRET=1), which is slow: shapes are kept small."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from pdserve.model import fp8_gemm  # noqa: E402
from pdserve.model.fp8 import (FP8_DTYPE, FP8_MAX, gemm_scale, quantize_activations, quantize_weight,  # noqa: E402
                               reference_linear)
from pdserve.model.model_config import Fp8Config  # noqa: E402
from pdserve.model.parallel import TPGroup  # noqa: E402
from tests.model.test_fp8_checkpoints import load  # noqa: E402
from tests.model.test_triton_kernels import DEVICE  # noqa: E402

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                       reason="needs Triton's interpreter or a GPU"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


@pytest.mark.parametrize("m, k, group", [(5, 300, 128), (33, 64, 32)])
def test_activation_quantiser_matches_the_reference(m, k, group):
    x = rand(m, k, seed=m, scale=3.0)
    x[1] = 0                                   # an all-zero row: zeros, not NaNs
    x[2, :group] *= 1e4                        # a group far larger than the next one
    x[3, :7] = torch.tensor([448 * 2.0 ** -9 * 1.5, 2.5 * 2 ** -9, -1e-12, 0.0, 1.0, -1.0, 2.0 ** -20])
    q, s = fp8_gemm.quantize_activations(x, group)
    rq, rs = quantize_activations(x.cpu(), group)
    assert q.dtype == FP8_DTYPE and s.shape == (m, -(-k // group))
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu().float(), rq.float())  # round to nearest even on the e4m3 grid, saturated
    assert not q.float().isnan().any() and float(q.float().abs().max()) == FP8_MAX


@pytest.mark.parametrize("m, n, k, group, dtype", [(1, 200, 300, 128, torch.float32),
                                                   (37, 96, 64, 32, torch.float32),
                                                   (20, 48, 160, 32, torch.bfloat16)])
def test_fp8_linear_matches_the_reference(m, n, k, group, dtype):
    quant = Fp8Config("fp8", "block", (group, group), "weight_scale_inv")
    w = rand(n, k, seed=1, scale=0.1).cpu()
    w[: n // 2] *= 30                          # blocks of very different scales
    wq, ws = quantize_weight(w, quant)
    scale = gemm_scale(ws, (n, k), quant, "w")
    x = rand(m, k, seed=2).to(dtype)
    bias = rand(n, seed=3).to(dtype)
    out = fp8_gemm.fp8_linear(x, wq.to(DEVICE), scale.to(DEVICE), group, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    want = reference_linear(x.cpu(), wq, scale, group) + bias.cpu().float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # summation order; bf16: the output's rounding
    torch.testing.assert_close(out.cpu().float(), want, rtol=tol, atol=tol * float(want.abs().max()))
    # The weight scales are applied: the same bytes with scale 1 give another result.
    ones = fp8_gemm.fp8_linear(x, wq.to(DEVICE), torch.ones_like(scale).to(DEVICE), group)
    assert not torch.allclose(ones.cpu().float(), want, atol=1e-2 * float(want.abs().max()))


def test_fp8_matmul_refuses_mismatched_scales():
    xq, xs = fp8_gemm.quantize_activations(rand(4, 64, seed=0), 32)
    w = torch.zeros(16, 64, dtype=FP8_DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match=r"scales must be \[16, 2\] and \[4, 2\]"):
        fp8_gemm.fp8_matmul(xq, xs, w, torch.ones(16, 1, device=DEVICE), 32, torch.float32)
    with pytest.raises(ValueError, match="power-of-two group of at least 16"):
        fp8_gemm.quantize_activations(rand(4, 64, seed=0), 48)


@pytest.mark.parametrize("method, strategy, block", [("fp8", "block", (16, 16)),
                                                     ("compressed-tensors", "channel", (128, 128))])
def test_fp8_layers_at_tp2_compute_the_dequantised_layers(method, strategy, block, fp8_dirs):
    """Each rank's fp8 projections of the dense layer (built as on CUDA) against the
    reference and the dequantised model: column-parallel outputs are this rank's rows of
    the full product, row-parallel partial sums add up to it. Block scales: a rank's input
    starts at a block, so its activation groups are the full input's and the sum is the
    TP 1 result; per-channel scales allow any split, the groups then start at the rank's
    first column (the sum differs from TP 1 by the activations' rounding only)."""
    fp8, ref = fp8_dirs("qwen3_moe", method, strategy, block)
    dense = load(ref).model.layers[1]          # the dense-MLP layer
    x = rand(6, 64, seed=4).cpu()
    h = rand(6, 96, seed=5).cpu()
    down_sum = torch.zeros(6, 64)
    for rank in (0, 1):
        layer = load(fp8, TPGroup(rank=rank, size=2), fp8_weights=True).model.layers[1]
        gate_up = layer.mlp.gate_up_proj
        assert gate_up.fp8_group == block[1] and gate_up.weight.dtype == FP8_DTYPE
        got = gate_up._matmul(x, None)
        want = reference_linear(x, gate_up.weight, gate_up.weight_scale, gate_up.fp8_group)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        lo, hi = gate_up.local[0]
        exact = x @ dense.mlp.gate_up_proj.weight.T  # the dequantised model, unquantised activations
        rows = torch.cat([exact[:, lo:hi], exact[:, 96 + lo:96 + hi]], dim=1)
        assert (got - rows).abs().max() <= 0.05 * rows.abs().max()  # activation rounding only
        down = layer.mlp.down_proj
        part = down._matmul(h[:, down.lo:down.hi], None)
        want = reference_linear(h[:, down.lo:down.hi], down.weight, down.weight_scale, down.fp8_group)
        torch.testing.assert_close(part, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        down_sum += part
    exact = h @ dense.mlp.down_proj.weight.T
    assert (down_sum - exact).abs().max() <= 0.05 * exact.abs().max()
    if strategy == "block":
        want = reference_linear(h, *_full(fp8, "model.layers.1.mlp.down_proj.weight"))
        torch.testing.assert_close(down_sum, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _full(model_dir, name):
    """The checkpoint's fp8 weight, its GEMM scales and group (unsharded)."""
    from safetensors.torch import load_file

    from pdserve.model.model_config import ModelConfig

    quant = ModelConfig.from_dir(model_dir).quant
    state = load_file(str(model_dir / "model.safetensors"))
    w = state[name]
    scale = state[name.removesuffix("weight") + quant.scale_suffix]
    return w, gemm_scale(scale, tuple(w.shape), quant, name), quant.group
