"""FP8 checkpoints (config.json quantization_config: quant_method fp8 with block scales
``weight_scale_inv``, compressed-tensors float8 with ``weight_scale``): an FP8 version of a
tiny random checkpoint (pdserve.testing.build_fp8_checkpoint) loads to exactly the weights
of its dequantised twin, written as a plain checkpoint, and generates the same greedy
tokens and logprobs, at TP 1 and TP 2 (CPU: dequantised at load). Layouts are checked
against transformers' own FP8 quantiser and dequantiser; unsupported configs are refused
by name. The FP8 GEMM path (keep_fp8) is built here; its kernels run in test_triton_fp8_gemm."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.model.fp8 import FP8_DTYPE, dequantize, gemm_scale, quantize_weight
from pdserve.model.loader import WeightLoadError, build_model
from pdserve.model.layers import WeightShapeError
from pdserve.model.model_config import Fp8Config, ModelConfig, ModelConfigError
from pdserve.model.parallel import TPGroup
from pdserve.model.registry import model_class
from tests.conftest import GREEDY, random_prompts

NEW = 12
BLOCK = Fp8Config(method="fp8", strategy="block", block=(128, 128), scale_suffix="weight_scale_inv")


def load(model_dir: Path, tp: TPGroup = TPGroup(), **kwargs: Any) -> torch.nn.Module:
    cfg = ModelConfig.from_dir(model_dir)
    return build_model(lambda: model_class(cfg)(cfg, tp), model_dir, "cpu", torch.float32, **kwargs)


def outputs(engine: Any, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=NEW), return_logprob=True)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def assert_same(got: list[tuple[list[int], list[float]]], want: list[tuple[list[int], list[float]]],
                tol: float) -> None:
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
        assert ids == ref_ids
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= tol


# ------------------------------------------------------------------ layouts vs transformers

@pytest.mark.fast
@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])
def test_block_layout_matches_transformers(shape):
    """Our block quantiser / dequantiser are transformers' FineGrainedFP8 ones, bit for bit
    (partial edge blocks included: its dequantiser for the backward pass handles them)."""
    fg = pytest.importorskip("transformers.integrations.finegrained_fp8")

    class Quantizer:
        class quantization_config:  # noqa: N801 (the attribute transformers reads)
            weight_block_size = (128, 128)
            scale_fmt = "float"

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.1
    w[:128, :128] = 0  # an all-zero block: scale 1
    q, s = quantize_weight(w, BLOCK)
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and q.dtype == FP8_DTYPE
    assert float(s[0, 0]) == 1.0
    if shape[0] % 128 == 0 and shape[1] % 128 == 0:  # its quantiser passes other shapes through
        theirs = fg.Fp8Quantize(Quantizer)._quantize_one("x.weight", w)
        assert torch.equal(q.view(torch.uint8), theirs["x.weight"].view(torch.uint8))
        assert torch.equal(s, theirs["x.weight_scale_inv"])
        assert torch.equal(dequantize(q, s, BLOCK), fg.Fp8Dequantize(Quantizer)._dequantize_one(q, s, torch.float32))
    assert torch.equal(dequantize(q, s, BLOCK), fg._dequantize_fp8_weight(q, s, [128, 128], torch.float32))
    assert (dequantize(q, s, BLOCK) - w).abs().max() <= w.abs().max() / 16  # e4m3: 3 mantissa bits


@pytest.mark.fast
@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_scales_dequantise_as_weight_times_scale(strategy):
    """compressed-tensors: W = W_fp8 * weight_scale ([out, 1] per channel, one value per tensor)."""
    quant = Fp8Config(method="compressed-tensors", strategy=strategy, block=None, scale_suffix="weight_scale")
    w = torch.randn(48, 200, generator=torch.Generator().manual_seed(1))
    w[3] *= 40  # one channel far larger: a per-channel scale follows it, a tensor scale covers all
    q, s = quantize_weight(w, quant)
    assert tuple(s.shape) == ((48, 1) if strategy == "channel" else (1,))
    want = q.float() * (s if strategy == "channel" else s[0])
    assert torch.equal(dequantize(q, s, quant), want)
    # The GEMM's layout: one scale per row and per 128 input columns.
    per_row = s.reshape(-1, 1) if strategy == "channel" else s.reshape(1, 1)
    assert torch.equal(gemm_scale(s, (48, 200), quant, "w"), per_row.expand(48, 2))


@pytest.mark.fast
def test_scale_shapes_are_checked():
    q, s = quantize_weight(torch.randn(200, 300), BLOCK)
    with pytest.raises(ValueError, match=r"x.weight_scale_inv: scale shape \(2, 2\), expected \(2, 3\)"):
        dequantize(q, s[:, :2], BLOCK, "x.weight_scale_inv")
    with pytest.raises(ValueError, match="must be stored as float8_e4m3fn"):
        dequantize(q.float(), s, BLOCK)


# ------------------------------------------------------------------ config

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100}
CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                              "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                  "strategy": "token"}}
DEEPSEEK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def ct(**changes: Any) -> dict[str, Any]:
    group = json.loads(json.dumps(CT_GROUP))
    for path, value in changes.items():
        node = group
        *parents, leaf = path.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group},
            "ignore": ["lm_head"]}


def quant_of(q: dict[str, Any] | None) -> Fp8Config | None:
    return ModelConfig.from_hf(dict(LLAMA, quantization_config=q) if q is not None else LLAMA).quant


@pytest.mark.fast
def test_supported_configs():
    assert quant_of(None) is None
    assert quant_of(DEEPSEEK) == BLOCK
    assert quant_of(dict(DEEPSEEK, modules_to_not_convert=["lm_head"])).ignore == ("lm_head",)
    channel = quant_of(ct())
    assert (channel.method, channel.strategy, channel.block, channel.scale_suffix, channel.group) == (
        "compressed-tensors", "channel", None, "weight_scale", 128)
    assert quant_of(ct(weights__strategy="tensor")).strategy == "tensor"
    block = quant_of(ct(weights__strategy="block", weights__block_structure=[64, 32], input_activations__strategy="group",
                        input_activations__group_size=32))
    assert (block.block, block.group) == ((64, 32), 32)
    assert quant_of(ct(input_activations=None)).strategy == "channel"  # weight-only: activations quantised anyway


@pytest.mark.fast
@pytest.mark.parametrize("q, message", [
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    (dict(DEEPSEEK, fmt="e5m2"), "fmt='e5m2'"),
    (dict(DEEPSEEK, activation_scheme="static"), "activation_scheme='static'"),
    (dict(DEEPSEEK, weight_block_size=None), "weight_block_size=None"),
    (dict(DEEPSEEK, weight_block_size=[128]), r"weight_block_size=\[128\]"),
    (dict(DEEPSEEK, scale_fmt="ue8m0"), "scale_fmt='ue8m0'"),
    (dict(DEEPSEEK, kv_scales=True), r"unknown key\(s\) \['kv_scales'\]"),
    (dict(ct(), format="pack-quantized"), "format='pack-quantized'"),
    (ct(weights__type="int"), "config_groups.group_0.weights.type='int'"),
    (ct(weights__num_bits=4), "config_groups.group_0.weights.num_bits=4"),
    (ct(weights__strategy="group", weights__group_size=128), "weights.strategy='group'"),
    (ct(weights__symmetric=False), "weights.symmetric=False"),
    (ct(weights__strategy="block"), "block_structure=None"),
    (ct(input_activations__dynamic=False), "input_activations.dynamic=False"),
    (ct(input_activations__type="int"), "input_activations="),
    (dict(ct(), sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config="),
    (dict(ct(), config_groups={"a": CT_GROUP, "b": dict(CT_GROUP, weights=dict(CT_GROUP["weights"],
                                                                               strategy="tensor"))}),
     "quantise weights differently"),
])
def test_unsupported_configs_are_refused_by_name(q, message):
    with pytest.raises(ModelConfigError, match=message):
        quant_of(q)


@pytest.mark.fast
def test_compression_config_is_refused():
    with pytest.raises(ModelConfigError, match="compression_config"):
        ModelConfig.from_hf(dict(LLAMA, compression_config={"quant_method": "sparseml"}))


@pytest.mark.fast
def test_ignore_lists_match_as_their_libraries_do():
    ct_quant = Fp8Config("compressed-tensors", "channel", None, "weight_scale",
                         ignore=("lm_head", "re:.*mlp\\.gate$"))
    assert ct_quant.ignores("lm_head") and ct_quant.ignores("model.layers.3.mlp.gate")
    assert not ct_quant.ignores("model.layers.3.mlp.gate_proj") and not ct_quant.ignores("model.lm_head.x")
    fp8_quant = Fp8Config("fp8", "block", (128, 128), "weight_scale_inv", ignore=("model.layers.1", "mlp.gate"))
    assert fp8_quant.ignores("model.layers.1.self_attn.q_proj") and not fp8_quant.ignores("model.layers.11.mlp.up_proj")
    assert fp8_quant.ignores("model.layers.5.mlp.gate") and not fp8_quant.ignores("model.layers.5.mlp.gate_proj")


# ------------------------------------------------------------------ loading

LAYOUTS = [("fp8", "block", (128, 128)), ("fp8", "block", (32, 32)), ("compressed-tensors", "channel", (128, 128)),
           ("compressed-tensors", "tensor", (128, 128)), ("compressed-tensors", "block", (32, 16))]


@pytest.mark.fast
@pytest.mark.parametrize("name", ["llama_gqa", "qwen3_moe"])
@pytest.mark.parametrize("method, strategy, block", LAYOUTS)
def test_fp8_checkpoint_loads_the_dequantised_weights(name, method, strategy, block, fp8_dirs, model_dirs, caplog):
    fp8, ref = fp8_dirs(name, method, strategy, block)
    with caplog.at_level(logging.INFO, logger="pdserve.model.loader"):
        model = load(fp8)
    want = dict(load(ref).named_parameters())
    original = dict(load(model_dirs(name)).named_parameters())
    quantised = 0
    for pname, param in model.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param, want[pname]), pname
        quantised += not torch.equal(param, original[pname])
    # Every linear (and, for MoE, the experts) went through fp8; embeddings, norms, the
    # LM head and the router did not.
    kinds = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "experts.gate_up", "experts.down"}
    changed = {p for p in model.state_dict() if not torch.equal(model.state_dict()[p], original[p])}
    assert changed and all(any(k in p for k in kinds) for p in changed) and quantised == len(changed)
    if name == "qwen3_moe":
        assert any("experts" in p for p in changed)
    line = [r.getMessage() for r in caplog.records if "FP8 checkpoint" in r.getMessage()]
    assert len(line) == 1 and f"({method}, {strategy} scales)" in line[0] and "kept in fp8" in line[0]
    assert "dequantised to torch.float32" in line[0]


@pytest.mark.fast
def test_weight_and_scale_in_different_shards_in_either_order(fp8_dirs):
    fp8, ref = fp8_dirs("qwen3_moe", "fp8", "block", (32, 32), split_shards=True)
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    apart = [n for n in index if n.endswith(".weight_scale_inv")
             and index[n] != index[n.removesuffix("_scale_inv")]]
    together = [n for n in index if n.endswith(".weight_scale_inv")
                and index[n] == index[n.removesuffix("_scale_inv")]]
    assert apart and together  # the scale read before or with its weight, in another file or the same
    want = dict(load(ref).named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in load(fp8).named_parameters())


def _rewrite(src: Path, dst: Path, edit_state: Callable[[dict], None] | None = None,
             edit_config: Callable[[dict], None] | None = None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    if edit_state:
        edit_state(state)
    save_file(state, str(dst / "model.safetensors"))
    if edit_config:
        cfg = json.loads((src / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.fast
def test_broken_fp8_checkpoints_are_refused_by_name(fp8_dirs, tmp_path):
    fp8, _ = fp8_dirs("llama_gqa")
    name = "model.layers.0.self_attn.o_proj"
    no_scale = _rewrite(fp8, tmp_path / "a", lambda s: s.pop(f"{name}.weight_scale_inv"))
    with pytest.raises(WeightLoadError, match=f"{name}.weight is stored as torch.float8_e4m3fn, but the "
                                              f"checkpoint has no {name}.weight_scale_inv"):
        load(no_scale)
    no_config = _rewrite(fp8, tmp_path / "b", edit_config=lambda c: c.pop("quantization_config"))
    with pytest.raises(WeightLoadError, match="config.json has no quantization_config"):
        load(no_config)
    stray = _rewrite(fp8, tmp_path / "c", lambda s: s.update({"model.layers.0.bogus.weight_scale_inv": torch.ones(1, 1)}))
    with pytest.raises(WeightLoadError, match=r"unexpected tensors \(1\): model.layers.0.bogus.weight_scale_inv"):
        load(stray)
    bad_shape = _rewrite(fp8, tmp_path / "d", lambda s: s.update({f"{name}.weight_scale_inv": torch.ones(2, 1)}))
    with pytest.raises(WeightShapeError, match=rf"{name}.weight_scale_inv: scale shape \(2, 1\), expected \(1, 1\)"):
        load(bad_shape)
    ignored = _rewrite(fp8, tmp_path / "e", edit_config=lambda c: c["quantization_config"].update(
        modules_to_not_convert=["o_proj"]))
    with pytest.raises(WeightLoadError, match=f"{name}.weight is stored in fp8, but quantization_config's ignore "
                                              r"list \['o_proj'\] names"):
        load(ignored)
    not_fp8 = _rewrite(fp8, tmp_path / "f", lambda s: s.update({f"{name}.weight": s[f"{name}.weight"].float()}))
    with pytest.raises(WeightLoadError, match=f"{name}.weight has a scale .* is stored as torch.float32"):
        load(not_fp8)


# ------------------------------------------------------------------ the FP8 GEMM layers (built, not run)

@pytest.mark.fast
def test_kept_fp8_layers_hold_the_checkpoint_bytes_and_row_scales(fp8_dirs):
    """With fp8 weights kept (CUDA; forced here) each linear and each MoE block's fused
    experts hold the checkpoint's fp8 bytes and per-row scales, TP-sharded; router,
    embeddings and LM head are dequantised as on a CPU."""
    fp8, ref = fp8_dirs("qwen3_moe", "fp8", "block", (16, 16))  # TP 2 splits the dense MLP's 96 at 48
    state = load_file(str(fp8 / "model.safetensors"))
    quant = ModelConfig.from_dir(fp8).quant
    want = dict(load(ref).named_parameters())
    for rank in (0, 1):
        tp = TPGroup(rank=rank, size=2)
        model = load(fp8, tp, fp8_weights=True)
        layer = model.model.layers[0]
        o_proj = layer.self_attn.o_proj
        assert o_proj.weight.dtype == FP8_DTYPE and o_proj.fp8_group == 16
        ck = "model.layers.0.self_attn.o_proj.weight"
        lo, hi = o_proj.lo, o_proj.hi
        assert torch.equal(o_proj.weight.view(torch.uint8), state[ck][:, lo:hi].view(torch.uint8))
        full = gemm_scale(state[ck + "_scale_inv"], tuple(state[ck].shape), quant, ck)
        assert torch.equal(o_proj.weight_scale, full[:, lo // 16: hi // 16])
        qkv = layer.self_attn.qkv_proj
        k_name = "model.layers.0.self_attn.k_proj.weight"
        k_lo, k_hi = qkv.local["k"]
        rows = slice(qkv.offsets["k"], qkv.offsets["k"] + k_hi - k_lo)
        assert torch.equal(qkv.weight[rows].view(torch.uint8), state[k_name][k_lo:k_hi].view(torch.uint8))
        k_full = gemm_scale(state[k_name + "_scale_inv"], tuple(state[k_name].shape), quant, k_name)
        assert torch.equal(qkv.weight_scale[rows], k_full[k_lo:k_hi])
        kept = {n for n, p in model.named_parameters() if p.dtype == FP8_DTYPE}
        assert kept == {f"model.layers.{i}.{m}.weight" for i in range(3)
                        for m in ("self_attn.qkv_proj", "self_attn.o_proj")} | {
            "model.layers.1.mlp.gate_up_proj.weight", "model.layers.1.mlp.down_proj.weight"} | {
            f"model.layers.{i}.mlp.experts.{m}.weight" for i in (0, 2) for m in ("gate_up", "down")}  # 1 is dense
        experts = layer.mlp.experts  # every expert's rank slice of its checkpoint bytes and row scales
        e_lo, e_hi = experts.lo, experts.hi
        for e in (0, 7):
            ck = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
            assert torch.equal(experts.down.weight[e].view(torch.uint8), state[ck][:, e_lo:e_hi].view(torch.uint8))
            full = gemm_scale(state[ck + "_scale_inv"], tuple(state[ck].shape), quant, ck)
            assert torch.equal(experts.down.weight_scale[e], full[:, e_lo // 16: e_hi // 16])
            ck = f"model.layers.0.mlp.experts.{e}.up_proj.weight"
            local = e_hi - e_lo
            assert torch.equal(experts.gate_up.weight[e, local:].view(torch.uint8),
                               state[ck][e_lo:e_hi].view(torch.uint8))
            full = gemm_scale(state[ck + "_scale_inv"], tuple(state[ck].shape), quant, ck)
            assert torch.equal(experts.gate_up.weight_scale[e, local:], full[e_lo:e_hi])
        if rank == 0:  # unsharded parameters equal the dequantised ones
            for n in ("model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "model.norm.weight"):
                assert torch.equal(model.get_parameter(n), want[n])


@pytest.mark.fast
def test_a_tp_shard_inside_a_scale_block_is_refused_naming_the_layer(fp8_dirs):
    fp8, _ = fp8_dirs("llama_gqa", "fp8", "block", (64, 64))
    with pytest.raises(WeightShapeError, match="o_proj: this TP rank's input columns start at 32, inside a "
                                               "64-column block"):
        load(fp8, TPGroup(rank=1, size=2), fp8_weights=True)
    load(fp8, TPGroup(rank=1, size=2))  # dequantised: any shard
    # Blocks the GEMM cannot walk (not a power of two): dequantised, not refused.
    odd, ref = fp8_dirs("llama_gqa", "compressed-tensors", "block", (24, 24))
    model = load(odd, fp8_weights=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    want = dict(load(ref).named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    # Per-channel scales do not vary along the input: any shard works with fp8 weights too.
    channel, _ = fp8_dirs("llama_gqa", "compressed-tensors", "channel")
    assert load(channel, TPGroup(rank=1, size=2), fp8_weights=True).model.layers[0].self_attn.o_proj.fp8_group == 128


# ------------------------------------------------------------------ engine parity

PARITY = [("llama_gqa", "fp8", "block", (128, 128)), ("llama_gqa", "compressed-tensors", "channel", (128, 128)),
          ("qwen3_moe", "fp8", "block", (32, 32)), ("qwen3_moe", "compressed-tensors", "channel", (128, 128))]


@pytest.mark.fast
@pytest.mark.parametrize("name, method, strategy, block", PARITY)
def test_greedy_outputs_equal_the_dequantised_checkpoint(name, method, strategy, block, fp8_dirs, model_dirs,
                                                        make_engine):
    fp8, ref = fp8_dirs(name, method, strategy, block)
    prompts = random_prompts(3, 5, 40, seed=7)
    want = outputs(make_engine(ref), prompts)
    assert_same(outputs(make_engine(fp8), prompts), want, tol=1e-5)
    # Quantisation changed the model: the parity above is not that of identical weights.
    original = outputs(make_engine(model_dirs(name)), prompts)
    assert max(abs(a - b) for (_, la), (_, lb) in zip(original, want) for a, b in zip(la, lb)) > 1e-4


@pytest.mark.parametrize("name, method, strategy, block", [PARITY[0], PARITY[3]])
def test_tp2_fp8_equals_the_dequantised_checkpoint(name, method, strategy, block, fp8_dirs, make_engine):
    fp8, ref = fp8_dirs(name, method, strategy, block)
    prompts = random_prompts(3, 5, 40, seed=8)
    want = outputs(make_engine(ref), prompts)
    got = outputs(make_engine(fp8, tp_size=2, chunked_prefill_size=32), prompts)
    assert_same(got, want, tol=1e-4)
