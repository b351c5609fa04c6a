"""FP8 KV cache (model/kv_quant.py): quantisation, the checkpoint's per-layer K/V scales
and their refusals, the fp8 pool (one byte per element, dequantised reads) and
torch_native attention over it against the dequantised reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.model.attention import TorchNativeAttention
from pdserve.model.forward_context import RowLayout
from pdserve.model.kv_quant import FP8_DTYPES, KVScales, dequantize, is_kv_scale_name, quantize, read_kv_scales
from pdserve.scheduler.memory import TokenToKVPool

pytestmark = pytest.mark.fast

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_flag_names_map_to_torch_fp8_dtypes():
    assert FP8_DTYPES == {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2}


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_divides_by_the_scale_and_saturates(dtype):
    fmax = torch.finfo(dtype).max
    x = torch.tensor([0.0, 1.0, -3.0, 2 * fmax, -4 * fmax, 0.3])
    q = quantize(x, 2.0, dtype)
    assert q.dtype == dtype and q.element_size() == 1
    # Past the finite range a plain cast gives NaN (e4m3fn) or inf (e5m2): saturated instead.
    assert torch.isfinite(q.float()).all()
    assert q.float()[3] == fmax and q.float()[4] == -fmax
    assert torch.equal(q.float()[:3], torch.tensor([0.0, 0.5, -1.5]))
    back = dequantize(q, 2.0, torch.float32)
    assert torch.equal(back, q.float() * 2.0)
    # bf16 input rounds once (through fp32), as an fp32 input of the same values does.
    xb = torch.randn(256, dtype=torch.bfloat16) * 10
    assert torch.equal(quantize(xb, 0.7, dtype).view(torch.uint8), quantize(xb.float(), 0.7, dtype).view(torch.uint8))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_pool_is_one_byte_per_element_half_of_bf16(dtype):
    shape = (4, 8, 64)
    assert (TokenToKVPool.bytes_per_token(*shape, dtype) * 2 == TokenToKVPool.bytes_per_token(*shape, torch.bfloat16)
            == 2 * 4 * 8 * 64 * 2)
    pool = TokenToKVPool("t", 4, 32, 8, 64, dtype, torch.device("cpu"), compute_dtype=torch.bfloat16)
    assert all(b.dtype == dtype and b.element_size() == 1 for b in pool.buffers().values())


def test_fp8_pool_needs_a_compute_dtype_and_scales_need_fp8():
    with pytest.raises(ValueError, match="compute dtype"):
        TokenToKVPool("t", 2, 8, 1, 4, E4M3, torch.device("cpu"))
    with pytest.raises(ValueError, match="fp8 KV pool only"):
        TokenToKVPool("t", 2, 8, 1, 4, torch.float32, torch.device("cpu"), scales=KVScales((2.0, 1.0), (1.0, 1.0)))
    with pytest.raises(ValueError, match="3 KV scales for a 2-layer"):
        TokenToKVPool("t", 2, 8, 1, 4, E4M3, torch.device("cpu"), scales=KVScales.ones(3),
                      compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="finite and > 0"):
        KVScales((0.0,), (1.0,))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_pool_write_quantises_and_reads_dequantise(dtype):
    scales = KVScales((0.5, 3.0), (2.0, 0.25))
    pool = TokenToKVPool("t", 2, 16, 2, 8, dtype, torch.device("cpu"), scales=scales, compute_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 8, generator=g) * 4, torch.randn(5, 2, 8, generator=g) * 4
    loc = torch.tensor([3, 9, 4, 15, 7])
    for layer in (0, 1):
        pool.write(layer, loc, k, v)
        sk, sv = scales.k[layer], scales.v[layer]
        # The buffer holds the fp8 of value / scale; reads give it back times the scale.
        assert torch.equal(pool.k[layer][loc].view(torch.uint8), quantize(k, sk, dtype).view(torch.uint8))
        assert torch.equal(pool.v[layer][loc].view(torch.uint8), quantize(v, sv, dtype).view(torch.uint8))
        gk, gv = pool.gather(layer, loc.view(1, 5))
        assert gk.dtype == torch.float32 and gk.shape == (1, 5, 2, 8)
        assert torch.equal(gk[0], quantize(k, sk, dtype).float() * sk)
        assert torch.equal(gv[0], quantize(v, sv, dtype).float() * sv)
        hk, hv = pool.gather_head_major(layer, loc.view(1, 5))
        assert torch.equal(hk, gk.transpose(1, 2)) and torch.equal(hv, gv.transpose(1, 2))
        sk2, sv2 = pool.stored_values(layer, k, v)
        assert torch.equal(sk2, gk[0]) and torch.equal(sv2, gv[0])
        assert pool.layer_scales(layer) == (sk, sv)
        # The error is fp8 rounding: relative 2^-4 (e4m3) / 2^-3 (e5m2) of each value, no more.
        rel = 2.0 ** -4 if dtype == E4M3 else 2.0 ** -3
        assert ((gk[0] - k).abs() <= rel * k.abs() + 1e-6).all()
    # copy_slots (n > 1 samples, compaction) moves the fp8 bytes.
    pool.copy_slots(torch.tensor([1, 2]), torch.tensor([3, 9]))
    assert torch.equal(pool.k[1][torch.tensor([1, 2])].view(torch.uint8), pool.k[1][loc[:2]].view(torch.uint8))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_torch_native_attention_over_fp8_matches_the_dequantised_reference(dtype):
    """An fp8 pool and an fp32 pool holding the fp8 pool's dequantised values give the
    same attention output, decode and extend (prefix + new tokens), to the bit."""
    hq, hkv, d, layers = 4, 2, 16, 2
    scales = KVScales((0.5, 2.0), (1.0, 0.125))
    fp8 = TokenToKVPool("a", layers, 64, hkv, d, dtype, torch.device("cpu"), scales=scales,
                        compute_dtype=torch.float32)
    ref = TokenToKVPool("b", layers, 64, hkv, d, torch.float32, torch.device("cpu"))
    table = torch.zeros(3, 32, dtype=torch.int64)
    table[0, :20] = torch.arange(1, 21)
    table[1, :12] = torch.arange(30, 42)
    g = torch.Generator().manual_seed(1)
    for layer in range(layers):
        k, v = torch.randn(31, hkv, d, generator=g), torch.randn(31, hkv, d, generator=g)
        slots = torch.cat([table[0, :19], table[1, :12]])
        fp8.write(layer, slots, k, v)
        dk, dv = fp8.gather(layer, slots)
        ref.write(layer, slots, dk, dv)
    a, b = TorchNativeAttention(fp8, hq, hkv, d), TorchNativeAttention(ref, hq, hkv, d)
    for rows, prefix, ext in (([0, 1], [19, 11], [1, 1]), ([0, 1], [12, 4], [8, 8]), ([0], [0], [20])):
        n = sum(ext)
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
        layout = RowLayout.upload(rows, prefix, ext, torch.device("cpu"))
        for layer in range(layers):
            out_a = a.forward(layer, q, k, v, a.context(table, layout))
            out_b = b.forward(layer, q, *fp8.stored_values(layer, k, v), b.context(table, layout))
            assert torch.equal(out_a, out_b)


def _layer_file(d: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / name))


def test_scale_names_vllm_and_sglang_read():
    for suffix in ("k_scale", "v_scale", "kv_scale", "attn.k_scale", "k_proj.output_scale", "v_proj.v_scale"):
        assert is_kv_scale_name(f"model.layers.3.self_attn.{suffix}")
    for other in ("model.layers.3.self_attn.q_scale", "model.layers.3.self_attn.k_proj.weight_scale",
                  "model.layers.3.mlp.k_scale", "model.layers.3.self_attn.prob_scale"):
        assert not is_kv_scale_name(other)


def test_read_kv_scales_from_checkpoints(tmp_path):
    assert read_kv_scales(_ckpt(tmp_path / "none", {}), 2) == KVScales.ones(2)
    kv = {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
          "model.layers.0.self_attn.v_scale": torch.tensor([2.0]),
          "model.layers.1.self_attn.k_proj.output_scale": torch.tensor(0.25),
          "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(4.0)}
    s = read_kv_scales(_ckpt(tmp_path / "kv", kv), 2)
    assert (s.k, s.v) == ((0.5, 0.25), (2.0, 4.0)) and s.digest().startswith("crc32:")
    shared = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(1.5) for i in range(2)}
    s = read_kv_scales(_ckpt(tmp_path / "shared", shared), 2)
    assert (s.k, s.v) == ((1.5, 1.5), (1.5, 1.5))


@pytest.mark.parametrize("tensors,match", [
    ({"model.layers.0.self_attn.k_scale": torch.ones(2)}, r"self_attn.k_scale has shape \(2,\).*per-head"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(1.0), "model.layers.0.self_attn.v_scale": torch.tensor(1.0)},
     r"not for 1.k_scale, 1.v_scale"),
    ({f"model.layers.{i}.self_attn.kv_scale": torch.tensor(1.0) for i in range(2)}
     | {"model.layers.1.self_attn.k_scale": torch.tensor(2.0)}, "layer 1 has two K scales"),
    ({f"model.layers.{i}.self_attn.kv_scale": torch.tensor(1.0) for i in range(3)}, "names layer 2"),
    ({f"model.layers.{i}.self_attn.kv_scale": torch.tensor(-1.0) for i in range(2)}, "finite and > 0"),
], ids=["per-head", "some-layers", "two-k-scales", "past-the-layers", "negative"])
def test_unsupported_scale_layouts_are_refused_by_name(tmp_path, tensors, match):
    with pytest.raises(ValueError, match=match):
        read_kv_scales(_ckpt(tmp_path, tensors), 2)


def _ckpt(d: Path, tensors: dict[str, torch.Tensor]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    _layer_file(d, "model.safetensors", {"model.embed_tokens.weight": torch.zeros(2, 2), **tensors})
    return d
