"""Forward context and the torch_native attention backend.

The scheduler describes a batch as rows of the request table plus how many
tokens each row already has in the KV pool (`prefix_lens`) and how many it adds
(`extend_lens`). `ForwardContext.build` turns that into the tensors attention
needs once per forward; every layer then reads them. New tokens are packed
([T, ...]); attention pads them to [B, Lq] only inside SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class KVStore(Protocol):
    """What attention needs from the KV pool (owned by the scheduler's memory module)."""

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather(self, layer: int, indices: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class ForwardContext:
    positions: torch.Tensor        # [T] position of each new token
    out_cache_loc: torch.Tensor    # [T] KV slot each new token is written to
    kv_indices: torch.Tensor       # [B, Lk] KV slots each row attends to (0 = padding slot)
    attn_mask: torch.Tensor        # [B, 1, Lq, Lk] True = may attend
    q_index: torch.Tensor | None   # [T] index of each packed token in the padded [B*Lq]; None if Lq == 1
    batch_size: int
    max_q_len: int

    @classmethod
    def build(cls, req_to_token: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
              extend_lens: torch.Tensor, extra_mask: torch.Tensor | None = None) -> "ForwardContext":
        """rows/prefix_lens/extend_lens: [B] int64 tensors on the model's device.
        extra_mask: optional [B, Lq, Lk] restriction ANDed into the causal mask
        (tree verification)."""
        device = rows.device
        batch = rows.shape[0]
        kv_lens = prefix_lens + extend_lens
        max_q = int(extend_lens.max())
        max_k = int(kv_lens.max())
        k_ar = torch.arange(max_k, device=device)
        kv_valid = k_ar.unsqueeze(0) < kv_lens.unsqueeze(1)                     # [B, Lk]
        kv_indices = torch.where(kv_valid, req_to_token[rows, :max_k], 0)
        if max_q == 1:
            positions = prefix_lens.clone()
            mask = kv_valid.view(batch, 1, 1, max_k)
            out_loc = kv_indices.gather(1, positions.unsqueeze(1)).squeeze(1)
            if extra_mask is not None:
                mask = mask & extra_mask.view(batch, 1, 1, max_k)
            return cls(positions, out_loc, kv_indices, mask, None, batch, 1)
        q_ar = torch.arange(max_q, device=device)
        q_valid = q_ar.unsqueeze(0) < extend_lens.unsqueeze(1)                  # [B, Lq]
        q_pos = prefix_lens.unsqueeze(1) + q_ar.unsqueeze(0)                     # [B, Lq]
        mask = (k_ar.view(1, 1, max_k) <= q_pos.unsqueeze(2)) & kv_valid.unsqueeze(1)
        if extra_mask is not None:
            mask = mask & extra_mask
        # Padding query rows attend to slot 0 only so SDPA never sees an all-False row.
        mask = mask & q_valid.unsqueeze(2)
        mask[:, :, 0] |= ~q_valid
        flat_valid = q_valid.reshape(-1)
        q_index = torch.nonzero(flat_valid).squeeze(1)
        positions = q_pos.reshape(-1)[q_index]
        out_loc = kv_indices.gather(1, q_pos.clamp(max=max_k - 1)).reshape(-1)[q_index]
        return cls(positions, out_loc, kv_indices, mask.unsqueeze(1), q_index, batch, max_q)


class TorchNativeAttention:
    """SDPA over KV gathered from the paged pool; runs anywhere torch runs."""

    def __init__(self, kv_pool: KVStore, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.pool = kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens; returns [T, Hq*D]."""
        self.pool.write(layer, ctx.out_cache_loc, k, v)
        keys, values = self.pool.gather(layer, ctx.kv_indices, q.dtype)      # [B, Hkv, Lk, D]
        b, lq = ctx.batch_size, ctx.max_q_len
        if ctx.q_index is None:
            # One new token per row: the query heads sharing a KV head act as that
            # head's query rows, so no KV expansion is needed for GQA.
            group = self.num_heads // self.num_kv_heads
            qg = q.view(b, self.num_kv_heads, group, self.head_dim)
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=ctx.attn_mask, scale=self.scale)
            return out.reshape(b, self.num_heads * self.head_dim)
        qp = q.new_zeros(b * lq, self.num_heads, self.head_dim)
        qp[ctx.q_index] = q
        qp = qp.view(b, lq, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=ctx.attn_mask, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)  # [B, Hq, Lq, D]
        out = out.transpose(1, 2).reshape(b * lq, self.num_heads * self.head_dim)
        return out[ctx.q_index]
