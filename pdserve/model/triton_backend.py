"""The triton attention backend: pdserve's own paged kernels (model/triton_attention.py).

Planned once per forward from the row layout (device tensors only; the host copy
gives the grid sizes), run once per layer. Nothing here reads the device, so a
decode forward can be captured in a CUDA graph. On a CPU it runs only under
Triton's interpreter (the tests' reference check against torch_native).

The kernels (and so triton) are imported when the backend is built, not when this
module is: config validation reads the class's capabilities without triton.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pdserve.model.attention_backends import BackendInfo
from pdserve.model.device_io import upload
from pdserve.model.forward_context import ForwardContext, KVStore, RowLayout, TreeMasks
from pdserve.model.kernel_checks import MAX_HEAD_DIM  # (no triton imported: the backend's checks read it)


@dataclass(frozen=True)
class DecodePlan:
    req_to_token: torch.Tensor
    rows: torch.Tensor       # [B] request-table rows
    seq_lens: torch.Tensor   # [B] keys per row, the new token included
    num_splits: int          # context chunks per row (split-KV), from shapes only


@dataclass(frozen=True)
class ExtendPlan:
    req_to_token: torch.Tensor
    rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    q_starts: torch.Tensor            # [B] first new token of each row in the packed batch
    max_extend: int                   # longest row's new tokens (grid size)
    custom_mask: torch.Tensor | None  # tree verification: rows' [q, q] visibility blocks, flat uint8
    mask_starts: torch.Tensor | None  # [B] offset of each row's block


@dataclass(frozen=True)
class TreeStepPlan:
    """A draft tree step: R = B x k branches, each one query over its request's prefix
    (read in place by the paged decode kernel) and its own i tree slots."""
    req_to_token: torch.Tensor
    rows: torch.Tensor           # [R] each branch's request-table row
    prefix_lens: torch.Tensor    # [R] its request's prefix length
    branch_slots: torch.Tensor   # [R, i] its ancestors' scratch slots, then its own
    num_splits: int


@dataclass(frozen=True)
class TreeRound:
    """What every tree step of one draft round shares (planned once)."""
    req_to_token: torch.Tensor
    rows: torch.Tensor
    prefix_lens: torch.Tensor


class TritonAttention(BackendInfo):
    name = "triton"
    devices = ("cuda",)
    auto_priority = 10  # auto's choice wherever it runs
    requires_package = "triton"
    supports_cuda_graphs = True
    supports_draft_tree = True

    @classmethod
    def device_refusal(cls, device_type: str) -> str | None:
        if device_type in cls.devices or os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return ("triton needs a CUDA device (on a CPU it runs only under Triton's interpreter, "
                "TRITON_INTERPRET=1, which the tests use); use torch_native")

    def __init__(self, kv_pool: KVStore, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"--attention-backend triton supports head_dim <= {MAX_HEAD_DIM}, "
                             f"the model has {head_dim}")
        k_buf = kv_pool.layer_buffers(0)[0]
        if (k_buf.dtype == torch.float8_e4m3fn and k_buf.is_cuda and torch.version.hip is None
                and torch.cuda.get_device_capability(k_buf.device) < (8, 9)):
            # Triton converts fp8e4nv only on sm_89+ (Ada, Hopper); e5m2 converts everywhere.
            raise ValueError("--kv-cache-dtype fp8_e4m3 with --attention-backend triton needs a GPU of compute "
                             "capability >= 8.9; use --kv-cache-dtype fp8_e5m2 or --attention-backend torch_native")
        from pdserve.model import triton_attention  # imports triton (TRITON_INTERPRET is read then)

        self.kernels = triton_attention
        self.pool = kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def context(self, req_to_token: torch.Tensor, layout: RowLayout,
                tree_masks: TreeMasks | None = None,
                positions: torch.Tensor | None = None) -> ForwardContext:
        ctx = ForwardContext.describe(req_to_token, layout, tree_masks, positions)
        ctx.plan = self.plan(req_to_token, layout, ctx.is_decode, tree_masks)
        return ctx

    def plan(self, req_to_token: torch.Tensor, layout: RowLayout, is_decode: bool,
             tree_masks: TreeMasks | None) -> DecodePlan | ExtendPlan:
        if is_decode:
            return DecodePlan(req_to_token, layout.rows, layout.prefix_lens + 1,
                              self.kernels.choose_num_splits(layout.batch_size, self.num_kv_heads))
        ext = layout.extend_lens
        custom = starts = None
        if isinstance(tree_masks, torch.Tensor):  # [B, q, q]: every row adds q tokens
            q = tree_masks.shape[1]
            custom = tree_masks.reshape(-1).to(torch.uint8)
            starts = torch.arange(layout.batch_size, device=ext.device) * (q * q)
        elif tree_masks is not None:
            device = ext.device
            blocks = [(m if m is not None else torch.ones(e, e, dtype=torch.bool, device=device).tril())
                      for m, e in zip(tree_masks, layout.host_extend)]
            custom = torch.cat([b.reshape(-1) for b in blocks]).to(torch.uint8)
            offsets, at = [], 0
            for e in layout.host_extend:
                offsets.append(at)
                at += e * e
            starts = upload(offsets, torch.int64, device)
        return ExtendPlan(req_to_token, layout.rows, layout.prefix_lens, ext, torch.cumsum(ext, 0) - ext, layout.max_extend,
                          custom, starts)

    # ---- the draft head's forwards (speculative.eagle_worker) -------------------------------
    def draft_extend_context(self, req_to_token: torch.Tensor, layout: RowLayout) -> ForwardContext:
        return self.context(req_to_token, layout)

    def plan_tree_round(self, req_to_token: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor,
                        longest: int) -> TreeRound:
        """``longest`` (the host's longest prefix) is not needed: the kernel reads lengths
        from the device, so a round's plan has fixed shapes (CUDA-graph safe)."""
        return TreeRound(req_to_token, rows, kv_lens)

    def tree_step_context(self, tree_round: TreeRound, branch_slots: torch.Tensor,
                          positions: torch.Tensor) -> ForwardContext:
        """One new token per branch: branch_slots [B, k, i] (its ancestors' slots then
        its own, where its KV is written), positions [B * k]."""
        b, k, i = branch_slots.shape
        plan = TreeStepPlan(tree_round.req_to_token, tree_round.rows.repeat_interleave(k),
                            tree_round.prefix_lens.repeat_interleave(k), branch_slots.reshape(b * k, i),
                            self.kernels.choose_num_splits(b * k, self.num_kv_heads))
        return ForwardContext(positions, branch_slots[:, :, -1].reshape(-1), b * k, True, plan=plan)

    def _tree_step(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                   plan: TreeStepPlan, k_scale: float, v_scale: float) -> torch.Tensor:
        """The prefix part from the paged decode kernel's per-split partials, the branch
        part (i keys per query) in torch, merged by their log-sum-exps: each branch reads
        its request's prefix where it lies, nothing is gathered or copied."""
        kn = self.kernels
        ws_out, ws_lse = kn.decode_partials(q, k_buf, v_buf, plan.req_to_token, plan.rows, plan.prefix_lens,
                                            self.scale, plan.num_splits, k_scale, v_scale)
        r, i = plan.branch_slots.shape
        hkv, d = self.num_kv_heads, self.head_dim
        keys = k_buf[plan.branch_slots].float() * k_scale                    # [R, i, Hkv, D]
        values = v_buf[plan.branch_slots].float() * v_scale
        qg = q.float().view(r, hkv, self.num_heads // hkv, d)               # query head h reads KV head h // group
        scores = torch.einsum("rhgd,rihd->rhgi", qg, keys) * (self.scale * kn.LOG2E)
        top = scores.amax(dim=-1, keepdim=True)
        weights = torch.exp2(scores - top)
        total = weights.sum(dim=-1, keepdim=True)
        branch_out = torch.einsum("rhgi,rihd->rhgd", weights / total, values).reshape(r, self.num_heads, 1, d)
        branch_lse = (top + torch.log2(total)).reshape(r, self.num_heads, 1)
        out = kn.merge_partials(torch.cat([ws_out, branch_out], dim=2), torch.cat([ws_lse, branch_lse], dim=2))
        return out.to(q.dtype)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens; returns [T, Hq*D]."""
        kn = self.kernels
        k_buf, v_buf = self.pool.layer_buffers(layer)
        ks, vs = self.pool.layer_scales(layer)
        if k_buf.dtype.itemsize == 1:  # fp8: the pool's quantiser, shared with torch_native
            self.pool.write(layer, ctx.out_cache_loc, k, v)
        else:
            kn.store_kv(k_buf, v_buf, ctx.out_cache_loc, k, v)
        plan = ctx.plan
        if isinstance(plan, TreeStepPlan):
            out = self._tree_step(q, k_buf, v_buf, plan, ks, vs)
        elif isinstance(plan, DecodePlan):
            out = kn.decode_attention(q, k_buf, v_buf, plan.req_to_token, plan.rows, plan.seq_lens, self.scale,
                                      plan.num_splits, k_scale=ks, v_scale=vs)
        else:
            assert isinstance(plan, ExtendPlan), "context() plans every forward"
            out = kn.extend_attention(q, k_buf, v_buf, plan.req_to_token, plan.rows, plan.prefix_lens,
                                      plan.extend_lens, plan.q_starts, plan.max_extend, self.scale, plan.custom_mask,
                                      plan.mask_starts, k_scale=ks, v_scale=vs)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
