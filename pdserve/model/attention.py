"""Forward context and the torch_native attention backend.

The scheduler describes a batch as rows of the request table plus how many
tokens each row already has in the KV pool (`prefix_lens`) and how many it adds
(`extend_lens`). `ForwardContext.build` turns that into what attention needs,
once per forward; every layer then reads it. New tokens are packed [T, ...].

Two shapes of work:
- decode (one new token per row): one batched SDPA over KV gathered into
  [B, Hkv, Lk, D], padded and masked to each row's length;
- extend (prefill chunks, later tree verification): one SDPA per row over that
  row's KV, causal kernels where the row has no prefix, so no compute is spent
  on padding when prompt lengths differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pdserve.model.decode_mirror import DecodeKVMirror, MirrorStep


class KVStore(Protocol):
    """What attention needs from the KV pool (owned by the scheduler's memory module)."""

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather_head_major(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class RowSpan:
    """One extend row: its new tokens are q[q_start: q_start + q_len]; it attends to
    kv[kv_start: kv_start + kv_len] of the packed gather, the last q_len of which are new."""
    q_start: int
    q_len: int
    kv_start: int
    kv_len: int
    mask: torch.Tensor | None  # [q_len, kv_len] bool; None = plain causal with no prefix


@dataclass
class ForwardContext:
    positions: torch.Tensor        # [T] position of each new token
    out_cache_loc: torch.Tensor    # [T] KV slot each new token is written to
    batch_size: int
    is_decode: bool
    # decode
    kv_indices: torch.Tensor | None = None  # [B, Lk] slots per row (0 = padding slot)
    attn_mask: torch.Tensor | None = None   # [B, 1, 1, Lk]
    mirror: "MirrorStep | None" = None      # set: read KV from the decode mirror, not the pool
    # extend
    kv_flat: torch.Tensor | None = None     # [sum kv_len] slots of all rows, row after row
    spans: tuple[RowSpan, ...] = ()
    # tree verification: every row adds the same number of tokens; one batched
    # SDPA over kv_indices with attn_mask [B, 1, q_per_row, Lk]
    q_per_row: int = 0
    # RoPE cos/sin at `positions`, per rotary table (filled by the first layer)
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def for_rows(cls, kv_indices: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                 out_cache_loc: torch.Tensor) -> "ForwardContext":
        """One new token per row attending to an explicit slot list (draft tree steps:
        the prefix plus the token's own ancestors). kv_indices / valid: [R, Lk]; the
        row's own slot (out_cache_loc) must be among its valid entries."""
        return cls(positions, out_cache_loc, kv_indices.shape[0], True,
                   kv_indices=torch.where(valid, kv_indices, 0), attn_mask=valid.view(valid.shape[0], 1, 1, -1))

    @classmethod
    def mirrored(cls, req_to_token: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
                 step: "MirrorStep") -> "ForwardContext":
        """A plain decode step whose KV the decode mirror serves (no slot lists needed)."""
        return cls(prefix_lens.clone(), req_to_token[rows, prefix_lens], rows.shape[0], True, mirror=step)

    @classmethod
    def build(cls, req_to_token: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
              extend_lens: torch.Tensor, extra_masks: list[torch.Tensor | None] | None = None,
              positions: torch.Tensor | None = None) -> "ForwardContext":
        """rows/prefix_lens/extend_lens: [B] int64 on the model device. extra_masks:
        per row an optional [q_len, q_len] restriction among the row's new tokens
        (tree verification), ANDed into the causal mask. ``positions`` [T]
        overrides the RoPE positions of the new tokens (a tree node sits at
        prefix + depth, while its KV slot follows its index)."""
        device = rows.device
        batch = rows.shape[0]
        kv_lens = prefix_lens + extend_lens
        if extra_masks is not None and batch > 1 and bool((extend_lens == extend_lens[0]).all()):
            return cls._uniform(req_to_token, rows, prefix_lens, int(extend_lens[0]), extra_masks, positions)
        if extra_masks is None and positions is None and bool((extend_lens == 1).all()):
            kv_indices, valid = _padded_slots(req_to_token, rows, kv_lens)
            max_k = kv_indices.shape[1]
            out_loc = req_to_token[rows, prefix_lens]
            return cls(prefix_lens.clone(), out_loc, batch, True, kv_indices=kv_indices,
                       attn_mask=valid.view(batch, 1, 1, max_k))
        total_q = int(extend_lens.sum())
        q_starts = torch.cumsum(extend_lens, 0) - extend_lens
        rep_rows = torch.repeat_interleave(rows, extend_lens)
        slot_pos = (torch.arange(total_q, device=device) - torch.repeat_interleave(q_starts, extend_lens)
                    + torch.repeat_interleave(prefix_lens, extend_lens))
        out_loc = req_to_token[rep_rows, slot_pos]
        if positions is None:
            positions = slot_pos
        total_kv = int(kv_lens.sum())
        kv_starts = torch.cumsum(kv_lens, 0) - kv_lens
        kv_rows = torch.repeat_interleave(rows, kv_lens)
        kv_pos = torch.arange(total_kv, device=device) - torch.repeat_interleave(kv_starts, kv_lens)
        kv_flat = req_to_token[kv_rows, kv_pos]
        spans = []
        for i, (qs, ql, ks, kl, pre) in enumerate(zip(q_starts.tolist(), extend_lens.tolist(),
                                                      kv_starts.tolist(), kv_lens.tolist(),
                                                      prefix_lens.tolist())):
            extra = extra_masks[i] if extra_masks is not None else None
            mask = None
            if pre > 0 or extra is not None:
                q_pos = pre + torch.arange(ql, device=device)
                mask = torch.arange(kl, device=device).unsqueeze(0) <= q_pos.unsqueeze(1)
                if extra is not None:
                    mask[:, pre:] &= extra.to(device)
            spans.append(RowSpan(qs, ql, ks, kl, mask))
        return cls(positions, out_loc, batch, False, kv_flat=kv_flat, spans=tuple(spans))


    @classmethod
    def _uniform(cls, req_to_token: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor, q_len: int,
                 extra_masks: list[torch.Tensor | None], positions: torch.Tensor | None) -> "ForwardContext":
        """Rows that each add ``q_len`` tokens restricted by ``extra_masks`` (a
        verified tree): keys are each row's prefix followed by its new tokens."""
        device = rows.device
        batch = rows.shape[0]
        kv_indices, valid = _padded_slots(req_to_token, rows, prefix_lens + q_len)
        max_k = kv_indices.shape[1]
        k_ar = torch.arange(max_k, device=device)
        q_idx = torch.arange(q_len, device=device)
        slot_pos = (prefix_lens.unsqueeze(1) + q_idx.unsqueeze(0))                     # [B, q]
        out_loc = req_to_token[rows.unsqueeze(1), slot_pos].reshape(-1)
        # prefix keys: all visible; new keys: as the row's extra mask says
        extra = torch.stack([m if m is not None else torch.ones(q_len, q_len, dtype=torch.bool, device=device)
                             .tril() for m in extra_masks]).to(device)                  # [B, q, q]
        rel = k_ar.view(1, 1, -1) - prefix_lens.view(-1, 1, 1)                          # [B, 1, Lk]
        in_tree = (rel >= 0) & (rel < q_len)
        tree_vis = torch.gather(extra, 2, rel.clamp(0, q_len - 1).expand(batch, q_len, max_k))
        mask = torch.where(in_tree, tree_vis, rel < 0) & valid.unsqueeze(1)
        pos = positions if positions is not None else slot_pos.reshape(-1)
        return cls(pos, out_loc, batch, False, kv_indices=kv_indices, attn_mask=mask.unsqueeze(1),
                   q_per_row=q_len)


def _padded_slots(req_to_token: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's KV slots [B, max kv_len], padded with slot 0, and the validity mask."""
    max_k = int(kv_lens.max())
    valid = torch.arange(max_k, device=rows.device).unsqueeze(0) < kv_lens.unsqueeze(1)
    return torch.where(valid, req_to_token[rows, :max_k], 0), valid


class TorchNativeAttention:
    """SDPA over KV gathered from the paged pool; runs anywhere torch runs."""

    def __init__(self, kv_pool: KVStore, num_heads: int, num_kv_heads: int, head_dim: int,
                 mirror: "DecodeKVMirror | None" = None) -> None:
        self.pool = kv_pool
        self.mirror = mirror  # serves the decode steps whose context carries a MirrorStep
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens; returns [T, Hq*D]."""
        self.pool.write(layer, ctx.out_cache_loc, k, v)
        if ctx.mirror is not None:
            assert self.mirror is not None, "a mirrored step needs the backend's mirror"
            return self.mirror.attend(layer, q, k, v, ctx.mirror, self.scale)
        if ctx.is_decode:
            return self._decode(layer, q, ctx)
        if ctx.q_per_row:
            return self._uniform(layer, q, ctx)
        return self._extend(layer, q, ctx)

    def _uniform(self, layer: int, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        assert ctx.kv_indices is not None
        keys, values = self.pool.gather_head_major(layer, ctx.kv_indices)   # [B, Hkv, Lk, D]
        b, n = ctx.batch_size, ctx.q_per_row
        qb = q.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)    # [B, Hq, n, D]
        out = F.scaled_dot_product_attention(qb, keys.to(q.dtype), values.to(q.dtype), attn_mask=ctx.attn_mask,
                                             scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).reshape(b * n, self.num_heads * self.head_dim)

    def _decode(self, layer: int, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        assert ctx.kv_indices is not None
        keys, values = self.pool.gather_head_major(layer, ctx.kv_indices)   # [B, Hkv, Lk, D]
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        # One new token per row: the query heads sharing a KV head act as that
        # head's query rows, so GQA needs no KV expansion.
        b = ctx.batch_size
        qg = q.view(b, self.num_kv_heads, self.group, self.head_dim)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=ctx.attn_mask, scale=self.scale)
        return out.reshape(b, self.num_heads * self.head_dim)

    def _extend(self, layer: int, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        assert ctx.kv_flat is not None
        keys, values = self.pool.gather(layer, ctx.kv_flat)                 # [N, Hkv, D]
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        gqa = self.num_heads != self.num_kv_heads
        for s in ctx.spans:
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
