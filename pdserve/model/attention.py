"""The torch_native attention backend: SDPA over KV gathered from the paged pool.

The forward's description and torch_native's plan (slot lists, masks, the shapes
of work) are in pdserve/model/forward_context.py; the registry of backends, their
capabilities and the ``AttentionBackend`` protocol in
pdserve/model/attention_backends.py. Both are re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pdserve.model.attention_backends import AttentionBackend, BackendInfo, DraftAttentionBackend
from pdserve.model.forward_context import (PAD_EXTEND_MAX, ForwardContext, GroupedQueries, KVStore, NativePlan,
                                           RowLayout, RowSpan, TreeMasks, new_token_positions, plan_torch_native)

if TYPE_CHECKING:
    from pdserve.model.decode_mirror import DecodeKVMirror

__all__ = ["PAD_EXTEND_MAX", "AttentionBackend", "DraftAttentionBackend", "ForwardContext", "GroupedQueries",
           "KVStore", "NativePlan", "RowLayout", "RowSpan", "TorchNativeAttention", "TreeMasks", "new_token_positions",
           "plan_torch_native"]


class TorchNativeAttention(BackendInfo):
    """SDPA over KV gathered from the paged pool; runs anywhere torch runs."""

    name = "torch_native"
    devices = ("cpu", "cuda")
    supports_draft_tree = True
    supports_decode_mirror = True

    def __init__(self, kv_pool: KVStore, num_heads: int, num_kv_heads: int, head_dim: int,
                 mirror: "DecodeKVMirror | None" = None) -> None:
        self.pool = kv_pool
        self.mirror = mirror  # serves the decode steps whose context carries a MirrorStep
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def context(self, req_to_token: torch.Tensor, layout: RowLayout,
                tree_masks: TreeMasks | None = None,
                positions: torch.Tensor | None = None) -> ForwardContext:
        """The forward's context, planned once for every layer."""
        return ForwardContext.build(req_to_token, layout, tree_masks, positions)

    # ---- the draft head's forwards (speculative.eagle_worker) -------------------------------
    def draft_extend_context(self, req_to_token: torch.Tensor, layout: RowLayout) -> ForwardContext:
        """The draft's catch-up: after a verify every row extends by a few tokens, so one
        padded SDPA serves them all, not one per row."""
        return ForwardContext.build(req_to_token, layout, pad_short_extends=True)

    def plan_tree_round(self, req_to_token: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor,
                        longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's prefix slots [B, longest] and their validity: the same for all
        tree steps of a round, so planned once (``longest`` is a host value: no read)."""
        pos = torch.arange(longest, device=rows.device)
        return req_to_token[rows.unsqueeze(1), pos.unsqueeze(0)], pos.unsqueeze(0) < kv_lens.unsqueeze(1)

    def tree_step_context(self, tree_round: tuple[torch.Tensor, torch.Tensor], branch_slots: torch.Tensor,
                          positions: torch.Tensor) -> ForwardContext:
        """One new token per branch: branch_slots [B, k, i] (its ancestors' slots then its
        own, where its KV is written), positions [B * k]."""
        prefix_slots, prefix_valid = tree_round
        return ForwardContext.for_tree_step(prefix_slots, prefix_valid, branch_slots, positions,
                                            branch_slots[:, :, -1].reshape(-1))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens; returns [T, Hq*D]."""
        self.pool.write(layer, ctx.out_cache_loc, k, v)
        plan: NativePlan = ctx.plan
        if plan.mirror is not None:
            assert self.mirror is not None, "a mirrored step needs the backend's mirror"
            return self.mirror.attend(layer, q, k, v, plan.mirror, self.scale)
        if plan.grouped is not None:
            return self._grouped(layer, q, plan.grouped)
        if ctx.is_decode:
            return self._decode(layer, q, ctx.batch_size, plan)
        if plan.q_per_row:
            return self._uniform(layer, q, ctx.batch_size, plan)
        return self._extend(layer, q, plan)

    def _uniform(self, layer: int, q: torch.Tensor, b: int, plan: NativePlan) -> torch.Tensor:
        assert plan.kv_indices is not None
        keys, values = self.pool.gather_head_major(layer, plan.kv_indices)  # [B, Hkv, Lk, D]
        n = plan.q_per_row
        qb = q.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)    # [B, Hq, n, D]
        out = F.scaled_dot_product_attention(qb, keys.to(q.dtype), values.to(q.dtype), attn_mask=plan.attn_mask,
                                             scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).reshape(b * n, self.num_heads * self.head_dim)

    def _grouped(self, layer: int, q: torch.Tensor, plan: GroupedQueries) -> torch.Tensor:
        """Each request's keys gathered once ([B, Hkv, Lk, D]: a draft step's prefix
        once for all k branches); the R tokens x group query heads of a KV head are
        that head's query rows [B, Hkv, R*group, D], so GQA copies no KV and SDPA
        can use a masked fused kernel (enable_gqa with a mask falls back to math on CUDA)."""
        keys, values = self.pool.gather_head_major(layer, plan.kv_indices)  # [B, Hkv, Lk, D]
        b, r = plan.visible.shape[0], plan.visible.shape[1]
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        if plan.q_index is not None:
            q = q.new_zeros(b * r, self.num_heads, d).index_copy_(0, plan.q_index, q)
        qg = q.view(b, r, hkv, g, d).transpose(1, 2).reshape(b, hkv, r * g, d)
        out = F.scaled_dot_product_attention(qg, keys.to(q.dtype), values.to(q.dtype), attn_mask=plan.mask(g),
                                             scale=self.scale)
        out = out.view(b, hkv, r, g, d).transpose(1, 2).reshape(b * r, self.num_heads * d)
        return out if plan.q_index is None else out.index_select(0, plan.q_index)

    def _decode(self, layer: int, q: torch.Tensor, b: int, plan: NativePlan) -> torch.Tensor:
        assert plan.kv_indices is not None
        keys, values = self.pool.gather_head_major(layer, plan.kv_indices)  # [B, Hkv, Lk, D]
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        # One new token per row: the query heads sharing a KV head act as that
        # head's query rows, so GQA needs no KV expansion.
        qg = q.view(b, self.num_kv_heads, self.group, self.head_dim)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=plan.attn_mask, scale=self.scale)
        return out.reshape(b, self.num_heads * self.head_dim)

    def _extend(self, layer: int, q: torch.Tensor, plan: NativePlan) -> torch.Tensor:
        assert plan.kv_flat is not None
        keys, values = self.pool.gather(layer, plan.kv_flat)                # [N, Hkv, D]
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        gqa = self.num_heads != self.num_kv_heads
        for s in plan.spans:
            qi = q[s.q_start: s.q_start + s.q_len].transpose(0, 1).unsqueeze(0)          # [1, Hq, q, D]
            ki = keys[s.kv_start: s.kv_start + s.kv_len].transpose(0, 1).unsqueeze(0).to(q.dtype)
            vi = values[s.kv_start: s.kv_start + s.kv_len].transpose(0, 1).unsqueeze(0).to(q.dtype)
            if s.mask is None:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale,
                                                   enable_gqa=gqa)
            else:
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=s.mask, scale=self.scale,
                                                   enable_gqa=gqa)
            out[s.q_start: s.q_start + s.q_len] = o.squeeze(0).transpose(0, 1).reshape(s.q_len, -1)
        return out
