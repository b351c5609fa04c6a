"""A forward's description (rows, KV slots, positions) and torch_native's metadata plan.

The scheduler describes a batch as rows of the request table plus how many
tokens each row already has in the KV pool (`prefix_lens`) and how many it adds
(`extend_lens`). `ForwardContext.build` turns that into what attention needs,
once per forward; every layer then reads it. New tokens are packed [T, ...].

The rows arrive as a ``RowLayout``: device tensors for the kernels and the same
numbers on the host, so planning a forward never reads the device (shapes and
loop bounds come from the host copy; on CUDA a read would stall the step).

What torch_native plans here (its SDPA calls are in pdserve/model/attention.py):
- decode (one new token per row): one batched SDPA over KV gathered into
  [B, Hkv, Lk, D], padded and masked to each row's length;
- extend (prefill chunks): one SDPA per row over that row's KV, causal kernels
  where the row has no prefix, so no compute is spent on padding when prompt
  lengths differ;
- uniform (tree verification, every row adds the same q_len tokens): one
  batched SDPA over [B, Hkv, Lk, D] with the tree masks ANDed in;
- grouped queries (``GroupedQueries``): KV gathered once per request as
  [B, Hkv, Lk, D]; a request's R query tokens times the `group` query heads of a
  KV head become that head's R*group query rows [B, Hkv, R*group, D], under a
  [B, 1, R*group, Lk] mask, in one SDPA (GQA without copying KV). Two users:
  * draft tree step (``ForwardContext.for_tree_step``): B requests with k
    frontier nodes each (R = k); keys are the request's prefix once, then the i
    tree slots of every branch (Lk = Lp + k*i); node j sees the valid prefix and
    its own i slots (ancestors and itself). The prefix is read once per request,
    not once per branch;
  * padded short extends (``pad_short_extends``: the draft's catch-up after a
    verify, 1..S tokens a row): packed [T] queries scatter into
    R = max_extend slots per row, causal mask over each row's prefix + extend;
    padding query rows are computed and dropped. One SDPA instead of one per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from pdserve.model.device_io import upload_rows

if TYPE_CHECKING:
    from pdserve.model.decode_mirror import MirrorStep

# Tree verification's ancestry masks: per row an optional [q, q] block, or one
# [B, q, q] tensor when every row adds the same q tokens (EAGLE: no per-row list).
TreeMasks = list["torch.Tensor | None"] | torch.Tensor


class KVStore(Protocol):
    """What attention needs from the KV pool (owned by the scheduler's memory module)."""

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather_head_major(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def layer_scales(self, layer: int) -> tuple[float, float]: ...

    def stored_values(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class RowLayout:
    """The rows of one forward: request-table row, tokens already in the KV pool
    (prefix) and tokens added (extend), on the device and, identical, on the host."""
    rows: torch.Tensor          # [B] int64, device
    prefix_lens: torch.Tensor   # [B] int64, device
    extend_lens: torch.Tensor   # [B] int64, device
    host_rows: tuple[int, ...]
    host_prefix: tuple[int, ...]
    host_extend: tuple[int, ...]

    @classmethod
    def upload(cls, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int],
               device: torch.device) -> "RowLayout":
        packed = upload_rows([list(rows), list(prefix_lens), list(extend_lens)], torch.int64, device)
        return cls(packed[0], packed[1], packed[2], tuple(rows), tuple(prefix_lens), tuple(extend_lens))

    @property
    def batch_size(self) -> int:
        return len(self.host_rows)

    @property
    def num_new_tokens(self) -> int:
        return sum(self.host_extend)

    @property
    def max_extend(self) -> int:
        return max(self.host_extend)

    @property
    def host_kv_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.host_prefix, self.host_extend)]

    @property
    def one_token_per_row(self) -> bool:
        return all(e == 1 for e in self.host_extend)

    @property
    def uniform_extend(self) -> bool:
        return all(e == self.host_extend[0] for e in self.host_extend)


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
class GroupedQueries:
    """Queries grouped by request over keys gathered once per request (draft tree
    steps, padded short extends): request b has R query tokens; token r sees
    kv_indices[b, c] where visible[b, r, c]. Packed queries are [B*R] in request
    order, or, with q_index, [T] that scatter to q_index in that [B*R] layout."""
    kv_indices: torch.Tensor            # [B, Lk] (padding -> slot 0)
    visible: torch.Tensor               # [B, R, Lk] bool, at least one key per query row
    q_index: torch.Tensor | None = None
    _masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask(self, group: int) -> torch.Tensor:
        """[B, 1, R*group, Lk]: the mask once the query heads sharing a KV head are
        folded into its query rows (token-major); built by the first layer, shared
        by the rest."""
        m = self._masks.get(group)
        if m is None:
            b, r, lk = self.visible.shape
            m = self._masks[group] = self.visible.unsqueeze(2).expand(b, r, group, lk).reshape(b, 1, r * group, lk)
        return m


@dataclass
class NativePlan:
    """What torch_native planned for one forward (``ForwardContext.plan``): slot lists
    and masks for SDPA, one shape of them per kind of forward."""
    # decode (and the tree verification below): slots per row, 0 = padding slot
    kv_indices: torch.Tensor | None = None  # [B, Lk]
    attn_mask: torch.Tensor | None = None   # [B, 1, 1, Lk] (tree verification: [B, 1, q_per_row, Lk])
    mirror: "MirrorStep | None" = None      # set: read KV from the decode mirror, not the pool
    # extend: every row's slots, row after row, and each row's span of them
    kv_flat: torch.Tensor | None = None     # [sum kv_len]
    spans: tuple[RowSpan, ...] = ()
    # tree verification: every row adds the same number of tokens; one batched SDPA
    q_per_row: int = 0
    # draft tree steps and padded short extends
    grouped: GroupedQueries | None = None


@dataclass
class ForwardContext:
    """A forward's description every backend shares (where the new tokens go, at which
    RoPE positions, tree masks) and the backend's own plan (``plan``: torch_native's
    ``NativePlan``, triton's launch metadata), made once per batch, read by every layer."""
    positions: torch.Tensor        # [T] position of each new token
    out_cache_loc: torch.Tensor    # [T] KV slot each new token is written to
    batch_size: int
    is_decode: bool
    layout: RowLayout | None = None
    # tree verification: per row an optional [q_len, q_len] restriction among the new tokens
    tree_masks: TreeMasks | None = None
    # what the attention backend planned for this forward (read by every layer)
    plan: Any = None
    # RoPE cos/sin at `positions`, per rotary table (filled by the first layer)
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def for_tree_step(cls, prefix_slots: torch.Tensor, prefix_valid: torch.Tensor, branch_slots: torch.Tensor,
                      positions: torch.Tensor, out_cache_loc: torch.Tensor) -> "ForwardContext":
        """One new token per tree branch (a draft tree step). prefix_slots /
        prefix_valid: [B, Lp], each request's prefix, padded to the longest;
        branch_slots: [B, k, i], each branch's ancestors' slots then its own
        (out_cache_loc [B*k] = branch_slots[:, :, -1], written before attention).
        positions: [B*k]. The prefix is planned, and later gathered, once per
        request rather than once per branch. torch_native only."""
        b, k, i = branch_slots.shape
        lp = prefix_slots.shape[1]
        kv_indices = torch.cat([torch.where(prefix_valid, prefix_slots, 0), branch_slots.reshape(b, k * i)], dim=1)
        # branch j owns columns [j*i, (j+1)*i) of the branch part
        owner = torch.arange(k * i, device=branch_slots.device) // i
        own = owner.unsqueeze(0) == torch.arange(k, device=branch_slots.device).unsqueeze(1)  # [k, k*i]
        visible = torch.cat([prefix_valid.unsqueeze(1).expand(b, k, lp), own.unsqueeze(0).expand(b, k, k * i)],
                            dim=2)
        return cls(positions, out_cache_loc, b * k, True, plan=NativePlan(grouped=GroupedQueries(kv_indices, visible)))

    @classmethod
    def mirrored(cls, req_to_token: torch.Tensor, layout: RowLayout, step: "MirrorStep") -> "ForwardContext":
        """A plain decode step whose KV the decode mirror serves (no slot lists needed)."""
        return cls(layout.prefix_lens.clone(), req_to_token[layout.rows, layout.prefix_lens], layout.batch_size,
                   True, layout=layout, plan=NativePlan(mirror=step))

    @classmethod
    def describe(cls, req_to_token: torch.Tensor, layout: RowLayout,
                 tree_masks: TreeMasks | None = None,
                 positions: torch.Tensor | None = None) -> "ForwardContext":
        """Where the new tokens go and at which RoPE positions; a backend's ``plan``
        adds what its kernels read. ``tree_masks``: per row an optional [q_len, q_len]
        restriction among the row's new tokens (tree verification), ANDed into the
        causal mask. ``positions`` [T] overrides the RoPE positions of the new tokens
        (a tree node sits at prefix + depth, while its KV slot follows its index)."""
        rows, prefix = layout.rows, layout.prefix_lens
        if tree_masks is None and positions is None and layout.one_token_per_row:
            return cls(prefix.clone(), req_to_token[rows, prefix], layout.batch_size, True, layout=layout)
        slot_pos = new_token_positions(layout)
        out_loc = req_to_token[torch.repeat_interleave(rows, layout.extend_lens, output_size=layout.num_new_tokens),
                               slot_pos]
        return cls(slot_pos if positions is None else positions, out_loc, layout.batch_size, False,
                   layout=layout, tree_masks=tree_masks)

    @classmethod
    def build(cls, req_to_token: torch.Tensor, layout: RowLayout,
              tree_masks: TreeMasks | None = None,
              positions: torch.Tensor | None = None, pad_short_extends: bool = False) -> "ForwardContext":
        """``describe`` plus the torch_native plan (the draft head and tests use it
        directly). ``pad_short_extends``: batch short extends into one padded SDPA
        (see ``plan_torch_native``)."""
        ctx = cls.describe(req_to_token, layout, tree_masks, positions)
        plan_torch_native(req_to_token, ctx, pad_short_extends)
        return ctx


def new_token_positions(layout: RowLayout) -> torch.Tensor:
    """[T] position of every new token within its row, rows packed one after another."""
    total = layout.num_new_tokens
    ext = layout.extend_lens
    q_starts = torch.cumsum(ext, 0) - ext
    return (torch.arange(total, device=ext.device)
            + torch.repeat_interleave(layout.prefix_lens - q_starts, ext, output_size=total))


# Longest extend the padded plan takes: after a verify round the draft extends each
# row by 1..S tokens; past this, queries padded to the longest row could cost more
# than the per-row kernels they replace (and a prompt's causal kernel is cheaper).
PAD_EXTEND_MAX = 16


def plan_torch_native(req_to_token: torch.Tensor, ctx: ForwardContext, pad_short_extends: bool = False) -> None:
    """Slot lists and masks for SDPA, from the host lengths (no device reads).
    ``pad_short_extends``: extends of at most PAD_EXTEND_MAX tokens a row (no tree
    masks) run as one padded SDPA instead of one SDPA per row."""
    layout = ctx.layout
    assert layout is not None
    device, rows, batch = layout.rows.device, layout.rows, layout.batch_size
    kv_lens = layout.host_kv_lens
    plan = ctx.plan = NativePlan()
    if ctx.is_decode:
        plan.kv_indices, valid = _padded_slots(req_to_token, layout, max(kv_lens))
        plan.attn_mask = valid.view(batch, 1, 1, -1)
        return
    if ctx.tree_masks is not None and batch > 1 and layout.uniform_extend:
        _plan_uniform(req_to_token, ctx)
        return
    if pad_short_extends and ctx.tree_masks is None and layout.max_extend <= PAD_EXTEND_MAX:
        _plan_padded(req_to_token, ctx)
        return
    total_kv = sum(kv_lens)
    kv_lens_dev = layout.prefix_lens + layout.extend_lens
    kv_starts = torch.cumsum(kv_lens_dev, 0) - kv_lens_dev
    kv_rows = torch.repeat_interleave(rows, kv_lens_dev, output_size=total_kv)
    kv_pos = torch.arange(total_kv, device=device) - torch.repeat_interleave(kv_starts, kv_lens_dev,
                                                                              output_size=total_kv)
    plan.kv_flat = req_to_token[kv_rows, kv_pos]
    spans = []
    q_start = kv_start = 0
    for i, (pre, ql) in enumerate(zip(layout.host_prefix, layout.host_extend)):
        kl = pre + ql
        extra = ctx.tree_masks[i] if ctx.tree_masks is not None else None
        mask = None
        if pre > 0 or extra is not None:
            q_pos = pre + torch.arange(ql, device=device)
            mask = torch.arange(kl, device=device).unsqueeze(0) <= q_pos.unsqueeze(1)
            if extra is not None:
                mask[:, pre:] &= extra.to(device)
        spans.append(RowSpan(q_start, ql, kv_start, kl, mask))
        q_start += ql
        kv_start += kl
    plan.spans = tuple(spans)


def _plan_uniform(req_to_token: torch.Tensor, ctx: ForwardContext) -> None:
    """Rows that each add ``q_len`` tokens restricted by tree masks (a verified
    tree): keys are each row's prefix followed by its new tokens."""
    layout, masks = ctx.layout, ctx.tree_masks
    assert layout is not None and masks is not None
    device, batch, q_len = layout.rows.device, layout.batch_size, layout.host_extend[0]
    prefix_lens = layout.prefix_lens
    kv_indices, valid = _padded_slots(req_to_token, layout, max(layout.host_kv_lens))
    max_k = kv_indices.shape[1]
    k_ar = torch.arange(max_k, device=device)
    # prefix keys: all visible; new keys: as the row's tree mask says
    if isinstance(masks, torch.Tensor):
        extra = masks.to(device)                                                     # [B, q, q]
    else:
        extra = torch.stack([m if m is not None else torch.ones(q_len, q_len, dtype=torch.bool, device=device)
                             .tril() for m in masks]).to(device)
    rel = k_ar.view(1, 1, -1) - prefix_lens.view(-1, 1, 1)                          # [B, 1, Lk]
    in_tree = (rel >= 0) & (rel < q_len)
    tree_vis = torch.gather(extra, 2, rel.clamp(0, q_len - 1).expand(batch, q_len, max_k))
    mask = torch.where(in_tree, tree_vis, rel < 0) & valid.unsqueeze(1)
    ctx.plan = NativePlan(kv_indices=kv_indices, attn_mask=mask.unsqueeze(1), q_per_row=q_len)


def _plan_padded(req_to_token: torch.Tensor, ctx: ForwardContext) -> None:
    """Short extends of any lengths as one batched SDPA: query j of row r sits at
    r * max_extend + j of a padded [B, max_extend] layout and sees keys
    [0, prefix_r + j]. A padding query (j >= extend_r) sees the row's valid keys
    (at least slot 0, so its softmax is finite); its output is dropped."""
    layout = ctx.layout
    assert layout is not None
    device, batch, q_len = layout.rows.device, layout.batch_size, layout.max_extend
    kv_indices, valid = _padded_slots(req_to_token, layout, max(layout.host_kv_lens))
    k_ar = torch.arange(kv_indices.shape[1], device=device)
    q_last_key = layout.prefix_lens.view(-1, 1) + torch.arange(q_len, device=device).view(1, -1)  # [B, q]
    mask = (k_ar.view(1, 1, -1) <= q_last_key.unsqueeze(2)) & valid.unsqueeze(1)               # [B, q, Lk]
    mask[:, :, 0] = True
    q_index = None
    if not layout.uniform_extend:
        ext = layout.extend_lens
        total = layout.num_new_tokens
        q_starts = torch.cumsum(ext, 0) - ext
        # packed token t of row r, j-th of its row: t = q_start_r + j -> r * q_len + j
        shift = torch.arange(batch, device=device) * q_len - q_starts
        q_index = torch.arange(total, device=device) + torch.repeat_interleave(shift, ext, output_size=total)
    ctx.plan = NativePlan(grouped=GroupedQueries(kv_indices, mask, q_index))


def _padded_slots(req_to_token: torch.Tensor, layout: RowLayout, max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's KV slots [B, max_k] (max_k: the longest row, from the host), padded
    with slot 0, and the validity mask."""
    kv_lens = layout.prefix_lens + layout.extend_lens
    valid = torch.arange(max_k, device=kv_lens.device).unsqueeze(0) < kv_lens.unsqueeze(1)
    return torch.where(valid, req_to_token[layout.rows, :max_k], 0), valid
