"""The GLM-4.5 benchmark (pdserve/bench/glm_mtp.py): its GLM-4.5-Air memory table is
checked against independent counts, so it cannot silently be wrong: transformers' own
Glm4MoeForCausalLM at that config on the meta device (parameters, fp8 weights and their
128x128-block scales), and pdserve's own model on the meta device with the FP8 GEMM
layers switched on as the loader does (loader.keep_fp8_layers) for the CUDA row. The
round-cost part runs at tiny sizes and reports greedy outputs equal to plain decoding."""

from __future__ import annotations

import re

import pytest
import torch

from pdserve.bench import glm_mtp
from pdserve.bench.glm_mtp import GLM45_AIR, BLOCK, memory_table

AIR = GLM45_AIR


def _blocks(rows: int, cols: int) -> int:
    return -(-rows // BLOCK) * -(-cols // BLOCK)


def _hf_air(num_layers: int):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(hidden_size=AIR.hidden, intermediate_size=AIR.intermediate,
                        moe_intermediate_size=AIR.moe_intermediate, num_hidden_layers=num_layers,
                        first_k_dense_replace=AIR.dense_layers, n_routed_experts=AIR.experts,
                        n_shared_experts=AIR.shared_experts, num_attention_heads=AIR.heads,
                        num_key_value_heads=AIR.kv_heads, head_dim=AIR.head_dim, vocab_size=AIR.vocab,
                        tie_word_embeddings=False, attention_bias=True, use_qk_norm=False, num_experts_per_tok=8,
                        n_group=1, topk_group=1, partial_rotary_factor=0.5)
    with torch.device("meta"):
        return cfg, Glm4MoeForCausalLM(cfg)


def _hf_counts(model) -> dict[str, int]:
    """From transformers' tensors: parameters, those stored in fp8 in a block-fp8
    checkpoint (every linear but the embeddings, LM head and router; its fused experts
    are stored per expert), their block scales, and the fp32 routing biases (buffers)."""
    out = dict(numel=0, fp8=0, scales=0, fp32=0)
    for name, p in model.named_parameters():
        out["numel"] += p.numel()
        if p.dim() < 2 or name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")):
            continue
        out["fp8"] += p.numel()
        if p.dim() == 3 and name.endswith("gate_up_proj"):  # [E, 2I, H]: gate_proj and up_proj of each expert
            e, two_i, h = p.shape
            out["scales"] += e * 2 * _blocks(two_i // 2, h)
        elif p.dim() == 3:  # down_proj [E, H, I]
            out["scales"] += p.shape[0] * _blocks(p.shape[1], p.shape[2])
        else:
            out["scales"] += _blocks(*p.shape)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            out["numel"] += b.numel()
            out["fp32"] += b.numel()
    return out


@pytest.fixture(scope="module")
def hf():
    """Counts of the target (46 layers) and of the NextN layer: one more MoE decoder layer
    (transformers builds none; a 47-layer model's last layer is its shape) + eh_proj
    [hidden, 2 hidden] + enorm, hnorm, shared_head.norm."""
    _, wide = _hf_air(AIR.layers + 1)
    target = _hf_counts(wide)
    layer = _hf_counts(wide.model.layers[AIR.layers])
    for k in target:
        target[k] -= layer[k]
    h = AIR.hidden
    nextn = dict(numel=layer["numel"] + 2 * h * h + 3 * h, fp8=layer["fp8"] + 2 * h * h,
                 scales=layer["scales"] + _blocks(h, 2 * h), fp32=layer["fp32"])
    return target, nextn


@pytest.mark.fast
def test_air_table_matches_transformers_count(hf):
    target, nextn = hf
    rows = {r.label: r.bytes for r in memory_table(AIR)}
    numel = target["numel"] + nextn["numel"]
    fp8 = target["fp8"] + nextn["fp8"]
    scales = target["scales"] + nextn["scales"]
    fp32 = target["fp32"] + nextn["fp32"]
    # The published size: ~106B parameters without the MTP layer.
    assert 106e9 < target["numel"] < 107.5e9
    assert rows["checkpoint, bf16"] == (numel - fp32) * 2 + fp32 * 4
    assert rows["checkpoint, block fp8"] == fp8 + scales * 4 + (numel - fp8 - fp32) * 2 + fp32 * 4
    assert rows["pdserve CPU, default dtype (fp32)"] == numel * 4
    assert rows["pdserve CPU, --dtype bfloat16"] == (numel - fp32) * 2 + fp32 * 4


@pytest.mark.fast
def test_air_cuda_row_matches_pdserves_own_fp8_layers(hf, tmp_path):
    """The CUDA row: pdserve's GLM-4.5 target at the Air config on the meta device, its
    linears and routed experts switched to fp8 by the loader's own rule (keep_fp8_layers,
    every weight with a scale: embeddings, LM head and router stay float), then bytes per
    dtype as materialize would make them on a bf16 CUDA model.
    The NextN draft is dequantised (bf16) whatever the device."""
    from pdserve.model.loader import _expected_names, keep_fp8_layers
    from pdserve.model.model_config import Fp8Config, ModelConfig
    from pdserve.model.parallel import TPGroup
    from pdserve.model.registry import model_class

    hf_cfg, _ = _hf_air(AIR.layers)
    raw = dict(hf_cfg.to_dict(), architectures=["Glm4MoeForCausalLM"], num_nextn_predict_layers=1,
               quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [BLOCK, BLOCK]})
    cfg = ModelConfig.from_hf(raw)
    quant = cfg.quant
    assert isinstance(quant, Fp8Config) and quant.block == (BLOCK, BLOCK)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, TPGroup())
    scales = {ckpt: torch.empty(0) for ckpt in _expected_names(model, tied=False).values()}
    keep_fp8_layers(model, quant, scales)
    held = 0
    kept = 0
    for p in model.parameters():
        if p.dtype == torch.float8_e4m3fn:
            held += p.numel()
            kept += p.numel()
        elif getattr(p, "keep_dtype", False):  # fp32 scales and routing biases
            held += p.numel() * 4
        else:
            held += p.numel() * 2
    target, nextn = hf
    assert sum(p.numel() for p in model.parameters() if not getattr(p, "fp8_scale", False)) == target["numel"]
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n
                  and p.dtype == torch.float8_e4m3fn)
    assert experts == (AIR.layers - AIR.dense_layers) * AIR.experts * 3 * AIR.moe_intermediate * AIR.hidden
    assert 5e9 < kept - experts < 7e9  # attention, dense MLP and shared experts
    draft = (nextn["numel"] - nextn["fp32"]) * 2 + nextn["fp32"] * 4
    rows = {r.label: r.bytes for r in memory_table(AIR)}
    assert rows["pdserve CUDA cc>=8.9 (bf16), FP8 GEMM"] == held + draft


def test_round_cost_smoke(capsys):
    glm_mtp.main(["--batch-sizes", "1", "2", "--shapes", "2,1,3", "--new", "12", "--repeats", "2",
                  "--threads", str(torch.get_num_threads())])  # leave the process as it was
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (plain|MTP \(2,1,3\)) \| (\d+) \| (-?[\d.]+) \|.*\| (yes|NO) \|$", out, re.M)
    assert sorted((c, int(b)) for c, b, _, _ in rows) == [("MTP (2,1,3)", 1), ("MTP (2,1,3)", 2), ("plain", 1),
                                                         ("plain", 2)]
    assert all(float(ms) > 0 and same == "yes" for _, _, ms, same in rows), out
    assert "a round costs" in out and "meaningless" in out
    # The measured FP8 part: both loads (target and NextN draft) logged, dequantised on CPU.
    assert out.count("loader: ") == 4 and "dequantised to torch.bfloat16" in out
