"""Contiguous copies of the running requests' KV for plain decode steps.

Why: the torch_native backend reads a decode row's KV by gathering its slots out
of the paged pool, every layer, every step. On CPU that gather was a third of a
decode step (the demo model, 8 rows of ~600 tokens) and is the same bytes each
step but one. The mirror keeps each running request's KV contiguous
([rows, kv_heads, capacity, head_dim] per layer), appends one token per step and
hands SDPA a strided view of it: no gather at all while the batch is stable.

The paged pool stays the only source of truth (radix cache, transfers,
retraction read it; every step still writes it). A request enters the mirror
with one gather of its whole prefix, and leaves it when a decode step no longer
contains it. Requests are identified by a key the scheduler derives from its
request-table row and that row's allocation count, so a row reused by another
request is never mistaken for the old one.

Mirror rows are kept dense ([0, n) for n requests); a batch may list them in any
order, so attention permutes the (small) queries instead of the KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model.attention import KVStore

_LEN_QUANTUM = 256  # capacity grows in these steps, so growth copies are rare


@dataclass
class MirrorStep:
    """What one decode step's attention reads (built once per forward)."""
    mirror_rows: torch.Tensor   # [B] mirror row of each batch row
    batch_of_row: torch.Tensor  # [n] batch row held by each mirror row 0..n-1 (n == B)
    positions: torch.Tensor     # [B] position each batch row writes this step
    attn_mask: torch.Tensor     # [n, 1, 1, L] valid keys per mirror row
    length: int                 # L: keys attended (max row length)
    in_order: bool              # mirror row i holds batch row i: no permutation needed


class DecodeKVMirror:
    def __init__(self, pool: KVStore, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, max_tokens: int) -> None:
        """``max_tokens`` bounds rows x capacity; past it a step falls back to the gather path."""
        self.pool = pool
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_tokens = max_tokens
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.row_of: dict[int, int] = {}   # request key -> mirror row
        self.lengths: list[int] = []        # tokens held per mirror row
        self.fills = 0                      # prefixes copied in (tests and stats)

    @property
    def capacity(self) -> tuple[int, int]:
        return (self.k[0].shape[0], self.k[0].shape[2]) if self.k else (0, 0)

    def clear(self) -> None:
        self.k, self.v, self.row_of, self.lengths = [], [], {}, []

    def prepare(self, keys: list[int], req_to_token: torch.Tensor, rows: torch.Tensor,
                prefix_lens: torch.Tensor) -> MirrorStep | None:
        """Make the mirror hold exactly the batch's requests with their first
        ``prefix_lens`` tokens; None (and the mirror emptied) when it would not fit."""
        prefix = prefix_lens.tolist()
        length = max(prefix) + 1
        if len(keys) * _round_up(length) > self.max_tokens:
            self.clear()
            return None
        self._drop_absent(set(keys))
        self._reserve(len(keys), length)
        # A request whose held length is not its prefix (never expected) is refilled.
        fresh = [i for i, (key, n) in enumerate(zip(keys, prefix))
                 if key not in self.row_of or self.lengths[self.row_of[key]] != n]
        for i in fresh:
            if keys[i] not in self.row_of:
                self.row_of[keys[i]] = len(self.lengths)
                self.lengths.append(0)
        if fresh:
            self._fill(fresh, [self.row_of[keys[i]] for i in fresh], req_to_token, rows, prefix)
        mirror_rows = [self.row_of[k] for k in keys]
        for r, n in zip(mirror_rows, prefix):
            self.lengths[r] = n + 1  # this step's token is written by every layer
        dev = self.device
        mrows = torch.tensor(mirror_rows, dtype=torch.int64, device=dev)
        batch_of_row = torch.empty_like(mrows)
        batch_of_row[mrows] = torch.arange(len(keys), device=dev)
        held = torch.tensor(self.lengths, dtype=torch.int64, device=dev)
        mask = torch.arange(length, device=dev).unsqueeze(0) < held.unsqueeze(1)
        return MirrorStep(mrows, batch_of_row, prefix_lens, mask.view(len(keys), 1, 1, length), length,
                          mirror_rows == list(range(len(keys))))

    def _drop_absent(self, keep: set[int]) -> None:
        """Forget requests not in this step, moving the last rows into the holes."""
        gone = [key for key in self.row_of if key not in keep]
        for key in gone:
            hole = self.row_of.pop(key)
            last = len(self.lengths) - 1
            if hole != last:
                moved = next(k for k, r in self.row_of.items() if r == last)
                n = self.lengths[last]
                for k, v in zip(self.k, self.v):
                    k[hole, :, :n] = k[last, :, :n]
                    v[hole, :, :n] = v[last, :, :n]
                self.row_of[moved] = hole
                self.lengths[hole] = n
            self.lengths.pop()

    def _reserve(self, rows: int, length: int) -> None:
        have_rows, have_len = self.capacity
        if rows <= have_rows and length <= have_len:
            return
        new_rows = max(rows, have_rows, 1)
        new_rows = 1 << (new_rows - 1).bit_length()
        new_len = max(_round_up(length), have_len)
        if new_rows * new_len > self.max_tokens:
            # Over budget with the rounded-up sizes: the exact need fits (prepare checked).
            new_rows, new_len = max(rows, have_rows), max(_round_up(length), have_len)
            if new_rows * new_len > self.max_tokens:
                new_rows, new_len = rows, _round_up(length)
        shape = (new_rows, self.num_kv_heads, new_len, self.head_dim)
        held = len(self.lengths)
        keep = max(self.lengths, default=0)
        for store in (self.k, self.v):
            for i in range(self.num_layers):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(store):
                    grown[:held, :, :keep] = store[i][:held, :, :keep]
                    store[i] = grown
                else:
                    store.append(grown)

    def _fill(self, batch_idx: list[int], mirror_rows: list[int], req_to_token: torch.Tensor,
              rows: torch.Tensor, prefix: list[int]) -> None:
        """Copy the prefixes of (re)entering requests out of the paged pool."""
        self.fills += len(batch_idx)
        n = max(prefix[i] for i in batch_idx)
        if n == 0:
            for r in mirror_rows:
                self.lengths[r] = 0
            return
        idx = torch.tensor(batch_idx, dtype=torch.int64, device=self.device)
        lens = torch.tensor([prefix[i] for i in batch_idx], dtype=torch.int64, device=self.device)
        valid = torch.arange(n, device=self.device).unsqueeze(0) < lens.unsqueeze(1)
        slots = torch.where(valid, req_to_token[rows[idx], :n], 0)
        dst = torch.tensor(mirror_rows, dtype=torch.int64, device=self.device)
        for layer in range(self.num_layers):
            k, v = self.pool.gather_head_major(layer, slots)  # [m, Hkv, n, D]
            self.k[layer][dst, :, :n] = k.to(self.dtype)
            self.v[layer][dst, :, :n] = v.to(self.dtype)
        for r, i in zip(mirror_rows, batch_idx):
            self.lengths[r] = prefix[i]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: MirrorStep,
               scale: float) -> torch.Tensor:
        """q: [B, Hq, D], k/v: [B, Hkv, D] of this step's tokens; returns [B, Hq*D]."""
        km, vm = self.k[layer], self.v[layer]
        k, v = self.pool.stored_values(layer, k, v)  # an fp8 pool's rounding, as a later refill would read
        km[step.mirror_rows, :, step.positions] = k.to(self.dtype)
        vm[step.mirror_rows, :, step.positions] = v.to(self.dtype)
        b, heads = q.shape[0], self.num_kv_heads
        # The query heads sharing a KV head act as that head's query rows (GQA without expansion).
        qm = q if step.in_order else q[step.batch_of_row]
        out = torch.nn.functional.scaled_dot_product_attention(
            qm.view(b, heads, -1, self.head_dim).to(self.dtype), km[:b, :, :step.length], vm[:b, :, :step.length],
            attn_mask=step.attn_mask, scale=scale).to(q.dtype)
        return (out if step.in_order else out[step.mirror_rows]).reshape(b, -1)


def _round_up(n: int) -> int:
    return -(-n // _LEN_QUANTUM) * _LEN_QUANTUM
