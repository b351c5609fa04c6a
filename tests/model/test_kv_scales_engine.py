"""A checkpoint that ships per-layer KV scales, in the engine: fp8 KV reads and applies
them (the pool holds value / scale), the default KV dtype loads the same checkpoint, a
bad layout is refused naming the flag and the tensor, and a draft head's checkpoint with
KV scales is refused (draft pools use 1.0)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.config import ConfigError
from pdserve.model.kv_quant import KVScales, quantize
from pdserve.testing import build_random_draft, build_random_model
from tests.conftest import GREEDY, random_prompts

K = (0.5, 0.25)
V = (2.0, 0.125)


@pytest.fixture(scope="module")
def scaled_dir(tmp_path_factory) -> Path:
    d = build_random_model(tmp_path_factory.mktemp("scaled"), "llama", num_layers=2, num_heads=4, num_kv_heads=2)
    save_file({**{f"model.layers.{i}.self_attn.k_scale": torch.tensor(K[i]) for i in range(2)},
               **{f"model.layers.{i}.self_attn.v_scale": torch.tensor(V[i]) for i in range(2)}},
              str(d / "kv_scales.safetensors"))
    return d


def test_checkpoint_scales_are_read_and_applied(make_engine, scaled_dir):
    prompts = random_prompts(2, 10, 20, seed=4)
    engine = make_engine(scaled_dir, kv_cache_dtype="fp8_e4m3", disable_radix_cache=True)
    runner = engine._scheduler.runner
    assert runner.kv_scales == KVScales(K, V, runner.kv_scales.source)
    pool = engine._scheduler.kv.kv_pool
    assert pool.scales.k == K and pool.scales.v == V
    engine.generate(input_ids=prompts[0], sampling_params=dict(GREEDY, max_new_tokens=1))
    # The first prompt's KV is still in the pool (freed slots keep their bytes): recompute
    # it through the pool's own write path with the scales and compare the stored bytes.
    k8 = pool.k[1][1:1 + len(prompts[0])]
    assert k8.float().abs().max() > 0
    deq = pool.gather(1, torch.arange(1, 1 + len(prompts[0])))[0]
    assert torch.equal(quantize(deq, K[1], torch.float8_e4m3fn).view(torch.uint8), k8.view(torch.uint8))
    # The default KV dtype loads the same checkpoint (the scales are no weights) and ignores them.
    plain = make_engine(scaled_dir)
    assert plain._scheduler.kv.kv_pool.scales == KVScales.ones(2)
    plain.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=4))


def test_bad_scale_layout_refused_naming_the_flag_and_tensor(make_engine, tmp_path, scaled_dir):
    d = tmp_path / "perhead"
    shutil.copytree(scaled_dir, d)
    save_file({"model.layers.0.self_attn.k_scale": torch.ones(2), "model.layers.0.self_attn.v_scale": torch.ones(2),
               "model.layers.1.self_attn.k_scale": torch.ones(2), "model.layers.1.self_attn.v_scale": torch.ones(2)},
              str(d / "kv_scales.safetensors"))
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype fp8_e5m2: .*self_attn.k_scale has shape \(2,\)"):
        make_engine(d, kv_cache_dtype="fp8_e5m2")


def test_draft_checkpoint_with_kv_scales_is_refused(make_engine, tmp_path, scaled_dir):
    draft = build_random_draft(scaled_dir, tmp_path / "e", "EAGLE")
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, str(draft / "kv_scales.safetensors"))
    with pytest.raises(Exception, match="k_scale"):
        make_engine(scaled_dir, kv_cache_dtype="fp8_e4m3", speculative_algorithm="EAGLE",
                    speculative_draft_model_path=str(draft), speculative_num_steps=2, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=3)
