"""FP8 MoE experts (model/moe.py ExpertStack.keep_fp8, the CUDA path, forced here): an FP8
checkpoint's routed experts keep the checkpoint's fp8 bytes with per-row fp32 scales
(model/fp8.py `gemm_scale`), TP-sharded like the float ones; the MoE block's grouped
forward runs the FP8 GEMM (model/fp8_gemm.py) per expert and computes, up to summation
order, what the torch reference of that GEMM computes, and up to the activations' fp8
rounding what the dequantised checkpoint's block computes. Without a GPU the kernels run
under Triton's interpreter (conftest sets TRITON_INTERPRET=1): sizes are kept small."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from safetensors.torch import load_file  # noqa: E402

from pdserve.model import loader  # noqa: E402
from pdserve.model.fp8 import FP8_DTYPE, gemm_scale, reference_linear  # noqa: E402
from pdserve.model.layers import WeightShapeError  # noqa: E402
from pdserve.model.model_config import ModelConfig  # noqa: E402
from pdserve.model.moe import FusedExperts, SparseMoeBlock  # noqa: E402
from pdserve.model.parallel import TPGroup  # noqa: E402
from pdserve.testing import build_fp8_checkpoint, build_random_model  # noqa: E402
from tests.conftest import GREEDY, random_prompts  # noqa: E402
from tests.model.test_fp8_checkpoints import load  # noqa: E402

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                       reason="needs Triton's interpreter or a GPU"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module")
def fp8_moe_dirs(model_dirs, tmp_path_factory) -> Callable[..., tuple[Path, Path]]:
    """(FP8 checkpoint, its dequantised twin) of qwen3_moe (tests/conftest.py) or a tiny
    GLM-4.5 (layer 0 dense, then MoE layers with a shared expert), per layout."""
    built: dict[tuple, tuple[Path, Path]] = {}

    def get(name: str, method: str = "fp8", strategy: str = "block", block: tuple[int, int] = (128, 128)):
        key = (name, method, strategy, block)
        if key not in built:
            root = tmp_path_factory.mktemp(f"{name}-{method}-{strategy}")
            src = build_random_model(root / "src", "glm4_moe") if name == "glm4_moe" else model_dirs(name)
            fp8 = build_fp8_checkpoint(src, root / "fp8", method, strategy=strategy, block=block,
                                       dequantized_dir=root / "ref")
            built[key] = (fp8, root / "ref")
        return built[key]
    return get


def moe_blocks(model: torch.nn.Module) -> dict[int, SparseMoeBlock]:
    return {i: layer.mlp for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)}


def reference_experts(experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                      ) -> torch.Tensor:
    """What FusedExperts.forward computes over fp8 weights, one (token, slot) at a time in
    fp32 torch (model/fp8.py reference_linear: the GEMM's activation quantisation included)."""
    gu, down = experts.gate_up, experts.down
    out = torch.zeros(x.shape[0], experts.hidden)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = reference_linear(x[t:t + 1], gu.weight[e], gu.weight_scale[e], gu.fp8_group).chunk(2, dim=-1)
            h = F.silu(gate) * up
            out[t] += weights[t, j] * reference_linear(h, down.weight[e], down.weight_scale[e], down.fp8_group)[0]
    return out


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


LAYOUTS = [("qwen3_moe", "fp8", "block", (128, 128)), ("glm4_moe", "fp8", "block", (16, 16)),
           ("glm4_moe", "compressed-tensors", "channel", (128, 128)), ("mixtral", "fp8", "block", (32, 32))]
# The checkpoint's gate and up matrices of expert {x} in layer {i}, per model.
GATE_UP_NAMES = {"mixtral": ("model.layers.{i}.block_sparse_moe.experts.{x}.w1.weight",
                             "model.layers.{i}.block_sparse_moe.experts.{x}.w3.weight")}
QWEN_GATE_UP = ("model.layers.{i}.mlp.experts.{x}.gate_proj.weight", "model.layers.{i}.mlp.experts.{x}.up_proj.weight")


@pytest.mark.parametrize("name, method, strategy, block", LAYOUTS)
def test_fp8_moe_block_computes_the_dequantised_block(name, method, strategy, block, fp8_moe_dirs):
    """Every MoE block of the fp8-kept model: float8 expert stacks holding the checkpoint's
    bytes (1 byte a weight, fp32 scales per row and group), the grouped forward equal to
    the GEMM's torch reference (fp32: summation order only), and to the dequantised
    checkpoint's block up to the activations' fp8 rounding."""
    fp8, ref = fp8_moe_dirs(name, method, strategy, block)
    quant = ModelConfig.from_dir(fp8).quant
    state = load_file(str(fp8 / "model.safetensors"))
    model, deq = load(fp8, fp8_weights=True), load(ref)
    blocks, ref_blocks = moe_blocks(model), moe_blocks(deq)
    assert blocks and blocks.keys() == ref_blocks.keys()
    group = quant.group
    for i, blk in blocks.items():
        experts = blk.experts
        e, h, inter = experts.num_experts, experts.hidden, experts.intermediate
        gu, down = experts.gate_up, experts.down
        assert gu.weight.dtype == down.weight.dtype == FP8_DTYPE and gu.fp8_group == down.fp8_group == group
        assert gu.weight.nbytes == e * 2 * inter * h and down.weight.nbytes == e * h * inter  # 1 byte a weight
        assert gu.weight_scale.dtype == torch.float32
        assert gu.weight_scale.nbytes == e * 2 * inter * -(-h // group) * 4
        assert down.weight_scale.nbytes == e * h * -(-inter // group) * 4
        # The checkpoint's bytes and scales, expert by expert; dequantised, the reference's weights.
        for x in range(e):
            for part, rows in zip(GATE_UP_NAMES.get(name, QWEN_GATE_UP), (slice(0, inter), slice(inter, 2 * inter))):
                ck = part.format(i=i, x=x)
                assert torch.equal(gu.weight[x, rows].view(torch.uint8), state[ck].view(torch.uint8))
                scale = gemm_scale(state[ck.removesuffix("weight") + quant.scale_suffix], (inter, h), quant, ck)
                assert torch.equal(gu.weight_scale[x, rows], scale)
            # Dequantised with the held scales: the reference checkpoint's weights, exactly.
            for stack, ref_stack in ((gu, ref_blocks[i].experts.gate_up), (down, ref_blocks[i].experts.down)):
                cols = stack.weight.shape[2]
                per_col = stack.weight_scale[x].repeat_interleave(group, dim=1)[:, :cols]
                assert torch.equal(stack.weight[x].float() * per_col, ref_stack.weight[x])
        x = rand(7, h, seed=i) * 2
        ids, weights = blk.gate(x)
        got = experts(x, ids, weights)
        want = reference_experts(experts, x, ids, weights)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        exact = ref_blocks[i](x)  # same routing: the router is float in both
        assert torch.equal(ref_blocks[i].gate(x)[0], ids)
        full = blk(x)
        assert (full - exact).abs().max() <= 0.08 * exact.abs().max()  # activation rounding only
        assert (full - exact).abs().max() > 0  # the fp8 GEMM ran, not the dequantised weights


def test_bf16_fp8_moe_block(fp8_moe_dirs):
    """A bf16 model's fp8 experts: the GEMM's fp32 accumulation, rounded once to bf16."""
    fp8, _ = fp8_moe_dirs("glm4_moe", "fp8", "block", (16, 16))
    cfg = ModelConfig.from_dir(fp8)
    from pdserve.model.registry import model_class

    model = loader.build_model(lambda: model_class(cfg)(cfg, TPGroup()), fp8, "cpu", torch.bfloat16,
                               fp8_weights=True)
    blk = moe_blocks(model)[1]
    assert blk.experts.gate_up.weight.dtype == FP8_DTYPE and blk.experts.gate_up.weight_scale.dtype == torch.float32
    x = rand(5, 64, seed=3).to(torch.bfloat16)
    ids, weights = blk.gate(x)
    got = blk.experts(x, ids, weights)
    want = reference_experts(blk.experts, x.float(), ids, weights)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2 * float(want.abs().max()))


def test_tp2_fp8_experts_sum_to_tp1(fp8_moe_dirs):
    """TP 2 splits each expert's intermediate dimension: gate/up rows and down's input
    columns (at a 16-column scale block); the ranks' partial sums add up to TP 1's result
    (block scales: a rank's activation groups are TP 1's, so only summation order differs)."""
    fp8, _ = fp8_moe_dirs("glm4_moe", "fp8", "block", (16, 16))
    whole = moe_blocks(load(fp8, fp8_weights=True))[1]
    x = rand(6, 64, seed=5)
    ids, weights = whole.gate(x)
    want = whole.experts(x, ids, weights)
    total = torch.zeros_like(want)
    for rank in (0, 1):
        experts = moe_blocks(load(fp8, TPGroup(rank=rank, size=2), fp8_weights=True))[1].experts
        assert experts.down.weight.shape == (8, 64, 16) and experts.down.weight.dtype == FP8_DTYPE
        assert torch.equal(experts.down.weight_scale, whole.experts.down.weight_scale[:, :, rank:rank + 1])
        total += experts(x, ids, weights)
    torch.testing.assert_close(total, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_a_tp_shard_inside_an_expert_scale_block_is_refused_naming_the_layer(fp8_moe_dirs):
    """moe_intermediate_size 32 at TP 2: rank 1's down input starts at 16, inside a 32-wide block."""
    fp8, _ = fp8_moe_dirs("glm4_moe", "fp8", "block", (32, 32))
    with pytest.raises(WeightShapeError, match=r"model\.layers\.1\.mlp\.experts\.down: this TP rank's input "
                                               "columns start at 16, inside a 32-column block"):
        load(fp8, TPGroup(rank=1, size=2), fp8_weights=True)
    # Dequantised (a CPU load): any shard.
    assert load(fp8, TPGroup(rank=1, size=2)).model.layers[1].mlp.experts.down.weight.dtype == torch.float32


def greedy(engine, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=new), return_logprob=True)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def test_greedy_outputs_of_the_fp8_moe_model_equal_the_dequantised_checkpoint(fp8_moe_dirs, make_engine,
                                                                             monkeypatch):
    """A whole engine on the fp8-kept Qwen3-MoE (every linear and expert through the FP8
    GEMM, as on CUDA) generates the dequantised checkpoint's greedy tokens; its logprobs
    differ by the activations' fp8 rounding only. Kept to 4 tokens: this random model's
    logits are nearly flat (top-2 logprob margins often under 0.1, the size of that
    rounding's effect here, up to 0.13 seen), so longer runs reach a near tie the rounding
    flips (at token 6 and 8 for these prompts), which says nothing about the kernels."""
    fp8, ref = fp8_moe_dirs("qwen3_moe", "fp8", "block", (128, 128))
    prompts = random_prompts(2, 4, 12, seed=7)
    want = greedy(make_engine(ref), prompts, 4)
    monkeypatch.setattr(loader, "fp8_available", lambda device: True)  # the CUDA rule, on this CPU
    engine = make_engine(fp8)
    model = engine._scheduler.runner.model
    blocks = moe_blocks(model)
    assert blocks and all(b.experts.gate_up.weight.dtype == b.experts.down.weight.dtype == FP8_DTYPE
                          for b in blocks.values())
    got = greedy(engine, prompts, 4)
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
        assert ids == ref_ids and len(ids) == 4
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 0.15
    assert any(a != b for (_, la), (_, lb) in zip(got, want) for a, b in zip(la, lb))  # not the float path
