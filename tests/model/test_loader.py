"""Checkpoint loading: strict name / shape checks, sharded checkpoints, unsupported configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

import pdserve
from pdserve.model.layers import WeightShapeError
from pdserve.model.loader import WeightLoadError
from pdserve.model.model_config import ModelConfig, ModelConfigError
from pdserve.testing import build_random_model

pytestmark = pytest.mark.fast

HIDDEN, INTER, LAYERS, KV_HEADS, HEAD_DIM = 32, 64, 2, 2, 8
GEN = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("ckpt") / "llama", "llama", hidden_size=HIDDEN,
                              num_layers=LAYERS, num_heads=4, num_kv_heads=KV_HEADS,
                              intermediate_size=INTER, seed=3)


def greedy_tokens(model_dir: Path) -> list[int]:
    engine = pdserve.Engine(model_path=str(model_dir), max_total_tokens=256)
    try:
        out = engine.generate(input_ids=[5, 6, 7], sampling_params=GEN)
    finally:
        engine.shutdown()
    return out["output_ids"]


@pytest.fixture(scope="module")
def base_tokens(base_model) -> list[int]:
    tokens = greedy_tokens(base_model)
    assert len(tokens) == 5
    return tokens


def corrupted_copy(base: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(base, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def edit_config(base: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    shutil.copytree(base, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def copy_without(base: Path, dst: Path, name: str) -> Path:
    """A copy of the checkpoint `base` without its file `name`."""
    shutil.copytree(base, dst)
    (dst / name).unlink()
    return dst


def assert_config_refused(model_dir: Path, match: str) -> None:
    """ModelConfig and the Engine both refuse the checkpoint, naming `match`."""
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dir(model_dir)
    with pytest.raises(ModelConfigError, match=match):
        pdserve.Engine(model_path=str(model_dir), max_total_tokens=256)


def test_base_checkpoint_loads(base_model, base_tokens):
    # the reference for the other tests really is the model: greedy is deterministic
    assert greedy_tokens(base_model) == base_tokens


# ---- missing / unexpected tensors ------------------------------------------------------------
@pytest.mark.parametrize("name", [
    "model.layers.1.self_attn.k_proj.weight",   # one shard of the fused qkv
    "model.layers.0.mlp.up_proj.weight",        # one shard of the fused gate_up
    "model.layers.1.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",                           # untied model
])
def test_missing_tensor_named(base_model, tmp_path, name):
    d = corrupted_copy(base_model, tmp_path / "m", lambda sd: sd.pop(name))
    with pytest.raises(WeightLoadError) as exc:
        pdserve.Engine(model_path=str(d), max_total_tokens=256)
    msg = str(exc.value)
    assert name in msg
    assert "missing" in msg
    # only the dropped tensor is reported
    report = msg.split("\n", 1)[1]  # the first line names the directory
    assert report.count("model.layers.") + report.count("lm_head") + report.count("model.norm") == 1


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.self_attn.q_proj.bias", (HIDDEN,)),              # bias the arch does not have
    (f"model.layers.{LAYERS}.mlp.up_proj.weight", (INTER, HIDDEN)),  # a layer beyond the config
    ("model.extra_head.weight", (3, 3)),
])
def test_unexpected_tensor_named(base_model, tmp_path, name, shape):
    d = corrupted_copy(base_model, tmp_path / "m", lambda sd: sd.__setitem__(name, torch.zeros(shape)))
    with pytest.raises(WeightLoadError) as exc:
        pdserve.Engine(model_path=str(d), max_total_tokens=256)
    msg = str(exc.value)
    assert name in msg
    assert "unexpected" in msg


def test_missing_and_unexpected_both_reported(base_model, tmp_path):
    def edit(sd):
        sd["model.layers.0.self_attn.qq_proj.weight"] = sd.pop("model.layers.0.self_attn.q_proj.weight")
    d = corrupted_copy(base_model, tmp_path / "m", edit)
    with pytest.raises(WeightLoadError) as exc:
        pdserve.Engine(model_path=str(d), max_total_tokens=256)
    msg = str(exc.value)
    assert "model.layers.0.self_attn.q_proj.weight" in msg
    assert "model.layers.0.self_attn.qq_proj.weight" in msg


def test_rotary_inv_freq_is_ignored(base_model, tmp_path, base_tokens):
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    d = corrupted_copy(base_model, tmp_path / "m", lambda sd: sd.__setitem__(name, torch.ones(HEAD_DIM // 2)))
    assert greedy_tokens(d) == base_tokens


# ---- wrong shapes ------------------------------------------------------------------------------
@pytest.mark.parametrize("name, shape", [
    ("model.layers.1.self_attn.q_proj.weight", (4 * HEAD_DIM, HIDDEN - 1)),
    ("model.layers.1.self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM + 1, HIDDEN)),
    ("model.layers.0.mlp.down_proj.weight", (HIDDEN, INTER + 1)),
    ("model.layers.1.input_layernorm.weight", (HIDDEN + 1,)),
    ("model.embed_tokens.weight", (7, HIDDEN)),
])
def test_wrong_shape_names_tensor(base_model, tmp_path, name, shape):
    d = corrupted_copy(base_model, tmp_path / "m", lambda sd: sd.__setitem__(name, torch.zeros(shape)))
    with pytest.raises((WeightShapeError, WeightLoadError)) as exc:
        pdserve.Engine(model_path=str(d), max_total_tokens=256)
    msg = str(exc.value)
    assert str(tuple(shape)) in msg        # the checkpoint's shape
    # The message must say WHICH tensor is wrong (a model has 2L+1 "norm weight"s).
    assert name in msg, f"shape error does not name the checkpoint tensor: {msg!r}"


# ---- sharded checkpoints ----------------------------------------------------------------------
def make_sharded(base: Path, dst: Path) -> Path:
    shutil.copytree(base, dst)
    state = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(state)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # interleave so each shard holds parts of every layer (and of each fused group)
    split = {files[0]: names[0::2], files[1]: names[1::2]}
    weight_map = {}
    for fname, part in split.items():
        save_file({n: state[n] for n in part}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_sharded_checkpoint_same_tokens(base_model, base_tokens, tmp_path):
    d = make_sharded(base_model, tmp_path / "sharded")
    assert not (d / "model.safetensors").exists()
    assert greedy_tokens(d) == base_tokens


def test_sharded_checkpoint_missing_shard(base_model, tmp_path):
    d = make_sharded(base_model, tmp_path / "sharded")
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightLoadError) as exc:
        pdserve.Engine(model_path=str(d), max_total_tokens=256)
    assert "model-00002-of-00002.safetensors" in str(exc.value)


def test_sharded_checkpoint_missing_tensor(base_model, tmp_path):
    d = make_sharded(base_model, tmp_path / "sharded")
    name = "model.layers.1.mlp.gate_proj.weight"
    fname = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
    state = load_file(str(d / fname))
    del state[name]
    save_file(state, str(d / fname), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.gate_proj\.weight"):
        pdserve.Engine(model_path=str(d), max_total_tokens=256)


def test_no_safetensors_files(base_model, tmp_path):
    d = copy_without(base_model, tmp_path / "empty", "model.safetensors")
    with pytest.raises(WeightLoadError, match="safetensors"):
        pdserve.Engine(model_path=str(d), max_total_tokens=256)


# ---- unsupported configs -------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_unsupported_rope_scaling_rejected(base_model, tmp_path, key):
    # (yarn is supported: tests/model/test_yarn.py)
    def edit(cfg):
        cfg.pop("rope_parameters", None)
        cfg[key] = {"rope_type": "longrope", "type": "longrope", "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8, "original_max_position_embeddings": 256, "rope_theta": 10000.0}
    assert_config_refused(edit_config(base_model, tmp_path / "m", edit), "longrope")


def test_legacy_type_key_dynamic_rejected(base_model, tmp_path):
    def edit(cfg):
        cfg.pop("rope_parameters", None)
        cfg["rope_theta"] = 10000.0
        cfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    d = edit_config(base_model, tmp_path / "m", edit)
    with pytest.raises(ModelConfigError, match="dynamic"):
        pdserve.Engine(model_path=str(d), max_total_tokens=256)


def test_unsupported_architecture_rejected(base_model, tmp_path):
    def edit(cfg):
        cfg["architectures"] = ["GPT2LMHeadModel"]
        cfg["model_type"] = "gpt2"
    assert_config_refused(edit_config(base_model, tmp_path / "m", edit), "GPT2LMHeadModel")


def test_missing_config_json(base_model, tmp_path):
    d = copy_without(base_model, tmp_path / "m", "config.json")
    with pytest.raises(ModelConfigError, match="config.json"):
        ModelConfig.from_dir(d)
