"""KV memory: request slots, paged token slots with reference counts, KV buffers.

Slot `s` of the KV pool lives in page `s // page_size`. Page 0 is never handed
out: slot 0 is the padding slot that batched attention reads for masked-out
positions, so it must always hold finite values.

A page is held by every owner that references it (a running request, a radix
tree node, a forked sample); it returns to the free list when the last owner
releases it. That makes sharing (prefix hits, n > 1 samples) safe without
copying and makes double frees visible (refcount < 0 raises).
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.model.kv_quant import KVScales, dequantize, is_fp8, quantize


class OutOfPages(RuntimeError):
    pass


class _PageStack:
    """Free page ids, last in first out, as a preallocated array. Entries may be stale (the
    page was taken another way since): popping drops them. The allocator keeps each page
    in at most one of its stacks (``stacked``), so a stack never outgrows the pool."""

    def __init__(self, num_pages: int, pages: np.ndarray) -> None:
        self._ids = np.zeros(num_pages, dtype=np.int64)
        self._ids[:pages.size] = pages
        self._top = pages.size

    def push(self, pages: np.ndarray) -> None:
        """``pages`` go on top, the last one on top."""
        self._ids[self._top:self._top + pages.size] = pages
        self._top += pages.size

    def pop(self, n: int, is_free: np.ndarray, stacked: np.ndarray) -> np.ndarray:
        """Up to ``n`` free pages off the top (fewer when the stack runs out)."""
        parts, got = [], 0
        while got < n and self._top:
            top = self._ids[max(0, self._top - (n - got)):self._top][::-1]
            self._top -= top.size
            stacked[top] = False
            parts.append(top[is_free[top]])
            got += parts[-1].size
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class PageAllocator:
    """Free pages with reference counts. Two ways to take pages:

    - off a stack (``alloc_ids(n)``): O(n), for a decode step's one page per request and a
      speculative round's scratch;
    - in runs (``alloc_ids(n, contiguous=True)``): the fewest runs of consecutive free
      pages (one when a free run is long enough), for a prompt's chunk and a PD request's
      reserved KV.

    A transfer writes one entry per run of consecutive slots on both sides. Decode steps
    interleave the running requests' pages, so a prompt taken off a stack once some of
    them finished is scattered in runs of a few tokens at page size 1. Runs keep it whole
    where the pool has room, and the stacks keep room: freed pages in runs of at least
    ``RUN_PAGES`` (a finished prompt) go on a stack of their own that single-page takes
    reach only when the stack of the others (decode steps' pages, leftovers) is empty.
    """

    RUN_PAGES = 8

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (one is the padding page)")
        self.page_size = page_size
        self.num_pages = num_pages
        self.refcount = torch.zeros(num_pages, dtype=torch.int32)
        self.refcount[0] = 1  # padding page: permanently held
        self._is_free = np.ones(num_pages, dtype=np.bool_)
        self._is_free[0] = False
        self._stacked = self._is_free.copy()
        # Low pages first keeps early requests' KV contiguous.
        self._scattered = _PageStack(num_pages, np.zeros(0, dtype=np.int64))
        self._in_runs = _PageStack(num_pages, np.arange(num_pages - 1, 0, -1, dtype=np.int64))
        self._num_free = num_pages - 1

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int, contiguous: bool = False) -> torch.Tensor:
        return torch.tensor(self.alloc_ids(n, contiguous), dtype=torch.int64)

    def alloc_ids(self, n: int, contiguous: bool = False) -> list[int]:
        """``n`` free pages, each held once; with ``contiguous``, in the fewest runs of
        consecutive pages (ascending within a run), else off the stacks."""
        if n > self._num_free:
            raise OutOfPages(f"need {n} KV pages, {self._num_free} free")
        if n == 0:
            return []
        if contiguous and n > 1:
            taken = self._runs_of(n)  # their stack entries stay, stale
        else:
            taken = self._scattered.pop(n, self._is_free, self._stacked)
            if taken.size < n:
                taken = np.concatenate([taken, self._in_runs.pop(n - taken.size, self._is_free, self._stacked)])
        self._is_free[taken] = False
        self._num_free -= n
        pages = taken.tolist()
        self.refcount[pages] = 1
        return pages

    def _runs_of(self, n: int) -> np.ndarray:
        """``n`` free pages in the fewest runs: the shortest free run that holds all of
        them (the lowest of equals), else the longest runs, in address order. One scan of
        the pool's free map (about 2 ms for a million pages)."""
        edges = np.diff(self._is_free.view(np.int8), prepend=np.int8(0), append=np.int8(0))
        starts = np.flatnonzero(edges == 1)
        lengths = np.flatnonzero(edges == -1) - starts
        fits = np.flatnonzero(lengths >= n)
        if fits.size:
            best = fits[np.argmin(lengths[fits])]
            return np.arange(starts[best], starts[best] + n, dtype=np.int64)
        order = np.argsort(-lengths, kind="stable")
        need = int(np.searchsorted(np.cumsum(lengths[order]), n)) + 1
        chosen = np.sort(order[:need])
        pages = np.concatenate([np.arange(starts[i], starts[i] + lengths[i], dtype=np.int64) for i in chosen])
        return pages[:n]

    def retain(self, pages: torch.Tensor) -> None:
        """Add one owner to each of `pages` (distinct, already allocated)."""
        if pages.numel():
            pages = pages.cpu()
            if bool((self.refcount[pages] <= 0).any()):
                raise RuntimeError("retain of a free KV page")
            self.refcount[pages] += 1

    def release(self, pages: torch.Tensor) -> None:
        """Drop one owner from each of `pages` (distinct); free those left unowned."""
        if not pages.numel():
            return
        pages = pages.cpu()
        # Check before changing anything, so a refused release leaves no half-done state.
        if bool((pages == 0).any()) or bool((self.refcount[pages] <= 0).any()):
            raise RuntimeError("KV page released more often than it was held")
        self.refcount[pages] -= 1
        freed = pages[self.refcount[pages] == 0].numpy()
        self._is_free[freed] = True
        self._num_free += freed.size
        # Pushed highest first, so a run comes back off its stack ascending. A page still on
        # a stack (a stale entry: it was taken in a run) is free there again.
        push = np.sort(freed[~self._stacked[freed]])
        self._stacked[push] = True
        if push.size < self.RUN_PAGES:  # too few to hold a run (a speculative round's scratch, each step)
            self._scattered.push(push[::-1])
            return
        breaks = np.flatnonzero(np.diff(push) != 1) + 1
        starts = np.concatenate(([0], breaks))
        lengths = np.diff(np.concatenate((starts, [push.size])))
        in_runs = np.repeat(lengths >= self.RUN_PAGES, lengths)
        self._in_runs.push(push[in_runs][::-1])
        self._scattered.push(push[~in_runs][::-1])


class ReqToTokenPool:
    """Row r maps request position i to its KV slot: table[r, i]."""

    def __init__(self, num_rows: int, max_context_len: int, device: torch.device) -> None:
        # One more row than requests: the padding row (never handed out, every
        # position mapping to the padding slot 0) that padded batches point at.
        self.table = torch.zeros(num_rows + 1, max_context_len, dtype=torch.int64, device=device)
        self.padding_row = num_rows
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self._allocations = [0] * num_rows  # per row, to tell its successive requests apart

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfPages("no free request slot")
        row = self._free.pop()
        self._allocations[row] += 1
        return row

    def key(self, row: int) -> int:
        """Names the request holding ``row`` now: no earlier or later holder shares it."""
        return self._allocations[row] * self.num_rows + row

    def free(self, row: int) -> None:
        if row in self._free:
            raise RuntimeError(f"request slot {row} freed twice")
        self._free.append(row)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


class TokenToKVPool:
    """Per layer one contiguous K and one V buffer of [num_slots, kv_heads, head_dim].

    Contiguous per-layer buffers are what a transfer engine registers; buffers
    are named (`target.L{i}.K`) so that two sides can pair them by name.

    An fp8 pool (``dtype`` float8_e4m3fn / float8_e5m2) stores one byte per element:
    ``write`` quantises with the layer's ``scales`` and the gathers return values
    dequantised to ``compute_dtype`` (the model's), so attention never sees fp8.
    The buffers themselves (transfers, the Triton kernels, copy_slots) hold the fp8
    bytes; a kernel reading them multiplies by ``layer_scales``.
    """

    def __init__(self, name: str, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, scales: KVScales | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        self.name = name
        self.num_slots = num_slots
        self.dtype = dtype
        self.fp8 = is_fp8(dtype)
        if self.fp8 and compute_dtype is None:
            raise ValueError(f"the {name} KV pool is {dtype}: it needs the compute dtype its reads dequantise to")
        if scales is not None and not self.fp8 and any(x != 1.0 for x in (*scales.k, *scales.v)):
            raise ValueError(f"KV scales apply to an fp8 KV pool only; the {name} pool is {dtype}")
        self.scales = scales or KVScales.ones(num_layers)
        if len(self.scales.k) != num_layers:
            raise ValueError(f"{len(self.scales.k)} KV scales for a {num_layers}-layer {name} pool")
        self.compute_dtype = compute_dtype or dtype
        # zeros, not empty: the padding slot (and never-written slots read under
        # a mask) must be finite or masked SDPA would produce NaN.
        self.k = [torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
                  for _ in range(num_layers)]
        self.v = [torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
                  for _ in range(num_layers)]

    def buffers(self) -> dict[str, torch.Tensor]:
        named: dict[str, torch.Tensor] = {}
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            named[f"{self.name}.L{i}.K"] = k
            named[f"{self.name}.L{i}.V"] = v
        return named

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.fp8:
            k = quantize(k, self.scales.k[layer], self.dtype)
            v = quantize(v, self.scales.v[layer], self.dtype)
        self.k[layer][loc] = k.to(self.dtype)
        self.v[layer][loc] = v.to(self.dtype)

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """What a reader of ``layer_buffers`` multiplies K and V by (1.0 unless fp8)."""
        return self.scales.k[layer], self.scales.v[layer]

    def stored_values(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a gather would return for ``k``/``v`` once written: a copy kept outside
        the pool (the decode mirror) must see the same rounded values the pool holds."""
        if not self.fp8:
            return k, v
        sk, sv = self.layer_scales(layer)
        return (dequantize(quantize(k, sk, self.dtype), sk, k.dtype),
                dequantize(quantize(v, sv, self.dtype), sv, v.dtype))

    def _read(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fp8:
            return k, v
        sk, sv = self.layer_scales(layer)
        return dequantize(k, sk, self.compute_dtype), dequantize(v, sv, self.compute_dtype)

    def gather(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `indices` (any shape) as [*indices.shape, kv_heads, head_dim]."""
        flat = indices.reshape(-1)
        shape = indices.shape + self.k[layer].shape[1:]
        # index_select on dim 0 is several times faster than advanced indexing on CPU.
        return self._read(layer, self.k[layer].index_select(0, flat).view(shape),
                          self.v[layer].index_select(0, flat).view(shape))

    def gather_head_major(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `indices` ([B, L]) as [B, kv_heads, L, head_dim], the layout SDPA
        wants, gathered in one pass (a [slots * heads, head_dim] view indexed per head
        is ~2.5x faster than gathering slots and transposing)."""
        k, v = self.k[layer], self.v[layer]
        heads, dim = k.shape[1], k.shape[2]
        rows = (indices.unsqueeze(1) * heads
                + torch.arange(heads, device=indices.device).view(1, heads, 1)).reshape(-1)
        shape = (indices.shape[0], heads, indices.shape[1], dim)
        return self._read(layer, k.view(-1, dim).index_select(0, rows).view(shape),
                          v.view(-1, dim).index_select(0, rows).view(shape))

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
