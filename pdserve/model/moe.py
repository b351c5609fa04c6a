"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, GLM-4.5).

A replicated router scores every expert for each token and keeps ``top_k`` of them
(``MoeRouting`` says how). Softmax (Qwen3-MoE, Mixtral): the ``top_k`` most probable,
in fp32; with ``norm_topk_prob`` (always for Mixtral) their probabilities are
renormalised to sum to 1, for Mixtral a softmax over the chosen logits. Sigmoid
(GLM-4.5, as transformers' Glm4MoeTopkRouter): fp32 sigmoid scores; the choice is made
on the scores plus the checkpoint's ``e_score_correction_bias`` (load balancing), first
keeping the best ``topk_group`` of ``n_group`` groups, then the best ``top_k`` inside
them; the weights are the uncorrected scores, renormalised with ``norm_topk_prob``
and times ``routed_scaling_factor``. Shared experts (GLM-4.5) are a dense MLP every
token goes through, added to the routed experts' output.

Expert weights are stored fused, ``gate_up`` [E, 2 * I_local, H] (this rank's gate rows,
then its up rows) and ``down`` [E, H, I_local], filled from the checkpoint's per-expert
matrices by ``weight_loader(tensor, shard)``. Tensor parallelism splits every expert's
intermediate dimension like the dense MLP's column/row pair: each rank computes every
routed token through its slice of each chosen expert, and the partial sums of the down
projection are all-reduced once per layer, after the experts' outputs are combined
(the combination is linear, so one reduction covers all of them).

Grouped compute: the (token, slot) assignments are sorted by expert, so each expert's
tokens form one contiguous slice of a gathered input; one matmul pair per expert that
received tokens runs over its slice, and the results are scattered back and summed
with the routing weights. That is one Python iteration per *expert* (E is fixed and
small next to a prefill's tokens) and no work for the experts nobody chose, whereas a
padded [E, capacity, H] bmm would compute E x capacity rows to serve T x k. The cost:
the per-expert counts are read on the host once per layer (a device sync on CUDA),
which is why decode CUDA graphs are refused for MoE models (see ModelRunner). The
shared experts' down projection is left unreduced too: with the routed partial sum
it makes one all-reduce per layer.

FP8 checkpoints on CUDA (loader.keep_fp8_layers, as for the linears): ``gate_up`` and
``down`` hold the checkpoint's float8_e4m3fn bytes with fp32 scales per output row and
per block width of input columns (model/fp8.py `gemm_scale`), and each expert's matmul
is the FP8 GEMM over its token slice (model/fp8_gemm.py `fp8_linear`: activations
quantised per token and column group). Elsewhere the experts are dequantised at load.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.layers import _attach_loader, _check_shape, _full_loader, keep_fp8_weight
from pdserve.model.model_config import ModelConfig, MoeRouting
from pdserve.model.parallel import TPGroup, shard_range

# Checkpoint names per layout: (gate, up, down) of expert `{e}`, relative to the MoE block.
QWEN3_MOE_EXPERT_NAMES = ("experts.{e}.gate_proj", "experts.{e}.up_proj", "experts.{e}.down_proj")
MIXTRAL_EXPERT_NAMES = ("experts.{e}.w1", "experts.{e}.w3", "experts.{e}.w2")


def expert_stacked_params(num_experts: int, names: tuple[str, str, str], block: str = "mlp"
                          ) -> tuple[tuple[str, str, object], ...]:
    """`CausalLM.stacked_params` entries mapping each checkpoint expert matrix to our
    fused parameters: gate -> ``mlp.experts.gate_up`` shard (e, 0), up -> (e, 1), down ->
    ``mlp.experts.down`` shard e. ``block`` is the checkpoint's name of the MoE module
    (Mixtral: ``block_sparse_moe``; ours is always ``mlp``), whose router is mapped too.
    They must precede the dense entries: the loader takes the first match, and the dense
    ``gate_proj`` entry would also match an expert's ``gate_proj``."""
    gate, up, down = names
    entries: list[tuple[str, str, object]] = []
    for e in range(num_experts):
        entries += [("mlp.experts.gate_up", f"{block}.{gate.format(e=e)}", (e, 0)),
                    ("mlp.experts.gate_up", f"{block}.{up.format(e=e)}", (e, 1)),
                    ("mlp.experts.down", f"{block}.{down.format(e=e)}", e)]
    if block != "mlp":
        entries.append(("mlp.gate", f"{block}.gate", None))
    return tuple(entries)


class ExpertStack(nn.Module):
    """One fused parameter ``weight`` [E, rows, cols] holding a matrix of every expert;
    after `keep_fp8`, float8 with fp32 scales ``weight_scale`` [E, rows, ceil(cols / group)]
    (each expert's as Linear.keep_fp8 holds a weight)."""

    # FP8 weights: input columns per scale (0: a float weight), as Linear.fp8_group.
    fp8_group: int = 0
    weight_scale: nn.Parameter  # registered by keep_fp8 only

    def __init__(self, shape: tuple[int, int, int], loader: Callable[[nn.Parameter], Callable],
                 scale_loader: Callable[[nn.Parameter], Callable], input_start: int, what: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))
        _attach_loader(self.weight, loader(self.weight))
        self._scale_loader = scale_loader
        self.input_start = input_start  # the first checkpoint input column of this rank's slice
        self.what = what

    def keep_fp8(self, group: int, scale_varies_along_input: bool, where: str = "") -> None:
        """As Linear.keep_fp8, for every expert's matrix (called by loader.keep_fp8_layers);
        ``where``: the module's name in the model, for the refusals."""
        self.weight_scale = keep_fp8_weight(self.weight, group, scale_varies_along_input, self.input_start,
                                            where or self.what)
        _attach_loader(self.weight_scale, self._scale_loader(self.weight_scale))
        self.fp8_group = group

    def matmul(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """x [n, cols] times expert ``e``'s matrix, transposed -> [n, rows] in x's dtype."""
        if self.fp8_group:
            from pdserve.model.fp8_gemm import fp8_linear  # Triton: imported only where weights are fp8

            return fp8_linear(x, self.weight[e], self.weight_scale[e], self.fp8_group)
        return F.linear(x, self.weight[e])


class FusedExperts(nn.Module):
    """Every expert's SwiGLU MLP, this rank's slice of each expert's intermediate dim."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = intermediate
        self.lo, self.hi = shard_range(intermediate, tp.rank, tp.size, "moe_intermediate_size")
        local = self.hi - self.lo
        # gate_up's rows are sharded (per-row scales: any start); down's input columns start at lo.
        self.gate_up = ExpertStack((num_experts, 2 * local, hidden), self._gate_up_loader,
                                    lambda p: self._gate_up_loader(p, " weight scale"), 0, "experts.gate_up")
        self.down = ExpertStack((num_experts, hidden, local), self._down_loader, self._down_scale_loader,
                                 self.lo, "experts.down")

    def _expert(self, e: object, what: str) -> int:
        if not isinstance(e, int) or not 0 <= e < self.num_experts:
            raise ValueError(f"{what}: expert {e!r} out of range (the model has {self.num_experts})")
        return e

    def _gate_up_loader(self, param: nn.Parameter, suffix: str = "") -> Callable[[torch.Tensor, object], None]:
        # Also the FP8 scales' loader (``suffix`` " weight scale"): [I, ceil(H / group)], a row
        # per weight row, sliced alike.
        def load(loaded: torch.Tensor, shard: object = None) -> None:
            assert isinstance(shard, tuple), "expert gate/up weights load by (expert, 0 gate | 1 up)"
            e, which = shard
            what = f"experts.{e}.{('gate', 'up')[which]}{suffix}"
            e = self._expert(e, what)
            _check_shape(loaded, (self.intermediate,) + tuple(param.shape[2:]), what)
            local = self.hi - self.lo
            param.data[e, which * local:(which + 1) * local].copy_(loaded[self.lo:self.hi])
        return load

    def _down_loader(self, param: nn.Parameter) -> Callable[[torch.Tensor, object], None]:
        def load(loaded: torch.Tensor, shard: object = None) -> None:
            e = self._expert(shard, f"experts.{shard}.down")
            _check_shape(loaded, (self.hidden, self.intermediate), f"experts.{e}.down")
            param.data[e].copy_(loaded[:, self.lo:self.hi])
        return load

    def _down_scale_loader(self, param: nn.Parameter) -> Callable[[torch.Tensor, object], None]:
        # [H, ceil(I / group)]: this rank's input columns start at a group boundary where the
        # scales vary along the input (keep_fp8 checks it), as RowParallelLinear's.
        def load(loaded: torch.Tensor, shard: object = None) -> None:
            what = f"experts.{shard}.down weight scale"
            e = self._expert(shard, what)
            group = self.down.fp8_group
            _check_shape(loaded, (self.hidden, -(-self.intermediate // group)), what)
            first = self.lo // group
            param.data[e].copy_(loaded[:, first:first + param.shape[2]])
        return load

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids / topk_weights [T, k] -> this rank's partial sum [T, H]
        (fp32) of sum_j weight_j * expert_{id_j}(x)."""
        tokens, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        # Assignments grouped by expert (stable: token order kept within an expert).
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # host: slice bounds
        grouped = x[order // k]
        out = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = grouped[start:start + n]
                gate, up = self.gate_up.matmul(rows, e).chunk(2, dim=-1)
                out[start:start + n] = self.down.matmul(F.silu(gate) * up, e)
                start += n
        per_slot = torch.empty_like(out)
        per_slot[order] = out  # back to (token, slot) order
        return (per_slot.view(tokens, k, self.hidden).float() * topk_weights.unsqueeze(-1)).sum(dim=1)


class Router(nn.Module):
    """The replicated gate: logits over experts, then top-k as ``routing`` says."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, renormalize: bool,
                 routing: MoeRouting = MoeRouting()) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        _attach_loader(self.weight, _full_loader(self.weight, "router gate"))
        self.e_score_correction_bias: nn.Parameter | None = None
        if routing.correction_bias:
            # fp32 whatever the model's dtype (as transformers keeps it): it decides between
            # experts whose scores may differ by less than a bf16 step.
            bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))
            bias.keep_dtype = True  # type: ignore[attr-defined]  # read by loader.materialize
            _attach_loader(bias, _full_loader(bias, "router e_score_correction_bias"))
            self.e_score_correction_bias = bias

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T, k] (most probable first) and their fp32 weights [T, k]."""
        if self.routing.scoring == "sigmoid":
            scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
            ids = self._choose(scores)
            weights = scores.gather(1, ids)
        else:
            probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routing.scaling_factor != 1.0:
            weights = weights * self.routing.scaling_factor
        return ids, weights

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The experts of each token from its sigmoid scores [T, E]: corrected by the
        bias, within the best groups (a group ranked by its two best corrected scores)."""
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        groups, keep = self.routing.num_groups, self.routing.topk_groups
        if keep < groups:
            tokens, experts = choice.shape
            grouped = choice.view(tokens, groups, experts // groups)
            best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(keep, dim=-1).indices  # [T, keep]
            kept = torch.zeros(tokens, groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
            choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(tokens, experts)
        return torch.topk(choice, self.top_k, dim=-1).indices


class SparseMoeBlock(nn.Module):
    """The MoE feed-forward replacing the dense MLP in the layers `MoeConfig` marks sparse;
    ``shared_experts`` (an MLP whose output is left unreduced) is added to every token's
    routed output."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.tp = tp
        self.gate = Router(moe.num_experts, cfg.hidden_size, moe.top_k, moe.norm_topk_prob, moe.routing)
        self.experts = FusedExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp)
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)  # both this rank's partial sums: one reduction
        return self.tp.all_reduce(out.to(x.dtype))
