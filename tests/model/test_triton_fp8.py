"""The Triton kernels over an fp8 KV cache (under Triton's interpreter on CPU): they load
the fp8 bytes and dequantise with the layer's scales; outputs match the fp32 reference
computed over the dequantised cache. In the engine, the triton backend with fp8 KV gives
torch_native's fp8 tokens (the same pool quantiser writes both)."""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")

from pdserve.model import triton_attention as ta  # noqa: E402
from pdserve.model.kv_quant import quantize  # noqa: E402
from tests.conftest import GREEDY, random_prompts  # noqa: E402
from tests.model.test_triton_kernels import (DEVICE, ints, make_cache, ref_decode, ref_extend,  # noqa: E402
                                             tree_mask)

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                       reason="needs Triton's interpreter or a GPU"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_cache(lens, page, hkv, d, dtype, k_scale, v_scale, seed=0):
    """An fp8 cache (values ~ N(0, 3) quantised with the scales) and its dequantised fp32 twin."""
    k, v, table, rows = make_cache(lens, page, hkv, d, torch.float32, seed=seed)
    k8, v8 = quantize(k * 3, k_scale, dtype), quantize(v * 3, v_scale, dtype)
    return k8, v8, k8.float() * k_scale, v8.float() * v_scale, table, rows


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_over_fp8_matches_the_dequantised_reference(dtype, splits):
    lens = [1, 17, 70, 33]
    k8, v8, kf, vf, table, rows = fp8_cache(lens, 16, 2, 32, dtype, 0.5, 2.0, seed=3)
    q = torch.randn(len(lens), 4, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out = ta.decode_attention(q, k8, v8, table, rows, ints(lens), 32 ** -0.5, splits, k_scale=0.5, v_scale=2.0)
    ref = ref_decode(q, kf, vf, table, rows, lens, 32 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=0)
    # The scales are applied: read as 1.0 the same bytes give another output.
    wrong = ta.decode_attention(q, k8, v8, table, rows, ints(lens), 32 ** -0.5, splits)
    assert not torch.allclose(wrong, ref, atol=1e-2)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("tree", [False, True])
def test_extend_over_fp8_matches_the_dequantised_reference(dtype, tree):
    prefix, ext = [0, 20, 40], [5, 30, 12]
    lens = [p + e for p, e in zip(prefix, ext)]
    k8, v8, kf, vf, table, rows = fp8_cache(lens, 16, 2, 32, dtype, 0.25, 1.5, seed=7)
    q = torch.randn(sum(ext), 4, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    masks = mask = starts = None
    if tree:
        rng = random.Random(1)
        masks = [tree_mask(e, rng) for e in ext]
        mask = torch.cat([m.flatten() for m in masks]).to(DEVICE)
        starts = ints([sum(e * e for e in ext[:b]) for b in range(len(ext))])
    q_starts = ints([sum(ext[:b]) for b in range(len(ext))])
    out = ta.extend_attention(q, k8, v8, table, rows, ints(prefix), ints(ext), q_starts, max(ext), 32 ** -0.5,
                              custom_mask=mask, mask_starts=starts, k_scale=0.25, v_scale=1.5)
    ref = ref_extend(q, kf, vf, table, rows, prefix, ext, masks, 32 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=0)


def test_store_kv_refuses_fp8_buffers():
    k8 = torch.zeros(8, 1, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    x = torch.zeros(1, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="TokenToKVPool.write"):
        ta.store_kv(k8, k8.clone(), ints([1]), x, x)


def test_triton_engine_with_fp8_kv_gives_torch_native_fp8_tokens(make_engine, llama_dir):
    prompts = random_prompts(3, 20, 40, seed=21)
    params = dict(GREEDY, max_new_tokens=8)
    ref = make_engine(llama_dir, attention_backend="torch_native", kv_cache_dtype="fp8_e4m3",
                      max_total_tokens=4096).generate(input_ids=prompts, sampling_params=params)
    engine = make_engine(llama_dir, attention_backend="triton", kv_cache_dtype="fp8_e4m3", page_size=16,
                         chunked_prefill_size=16, max_total_tokens=4096)
    assert engine._scheduler.kv.kv_pool.k[0].dtype == torch.float8_e4m3fn
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]


def test_triton_eagle_tree_with_fp8_kv_matches_torch_native(make_engine, tmp_path_factory):
    """The draft's tree steps (paged decode partials plus the branch slots, both scaled) and
    the target's verification over fp8 KV: torch_native's tokens and acceptance."""
    from pdserve.testing import build_random_draft, build_random_model

    target = build_random_model(tmp_path_factory.mktemp("f8_t"), "llama", num_layers=2, num_heads=4,
                                num_kv_heads=2, hidden_size=64)
    draft = build_random_draft(target, tmp_path_factory.mktemp("f8_d") / "e", "EAGLE", seed=1)
    prompts = random_prompts(2, 20, 40, seed=21)
    params = dict(GREEDY, max_new_tokens=10)
    eagle = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft), speculative_num_steps=3,
                 speculative_eagle_topk=2, speculative_num_draft_tokens=5, kv_cache_dtype="fp8_e5m2")
    spec = make_engine(target, attention_backend="triton", **eagle)
    assert spec._scheduler.spec.draft_pool.k[0].dtype == torch.float8_e5m2
    outs = spec.generate(input_ids=prompts, sampling_params=params)
    native = make_engine(target, attention_backend="torch_native", **eagle).generate(input_ids=prompts,
                                                                                      sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in native]
    assert ([o["meta_info"]["spec_accepted_drafts"] for o in outs]
            == [o["meta_info"]["spec_accepted_drafts"] for o in native])
