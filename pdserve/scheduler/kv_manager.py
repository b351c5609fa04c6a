"""The one owner of a scheduler rank's KV bookkeeping (how large its pools are is
``memory_budget``'s question).

It holds the page allocator, the request table (row -> position -> slot), the
target KV pool and the prefix cache, and is the only code that moves pages
between them: attaching a cached prefix, giving positions slots, forking
samples, compacting a speculative round, holding a failed transfer's pages,
releasing a request. Schedulers (colocated, prefill, decode) decide *when*;
this class decides *which pages* and keeps the reference counts right.

Invariant: every page a request's row points at below ``kv_len`` (and up to the
page holding its last assigned slot) is held once by that request; a cached
prefix is additionally held by its radix node.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.config import ServerArgs
from pdserve.model.attention import RowLayout
from pdserve.model.device_io import upload
from pdserve.model.kv_quant import KVScales
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.memory import PageAllocator, ReqToTokenPool, TokenToKVPool
from pdserve.scheduler.radix_cache import ChunkCache, PrefixMatch, RadixCache
from pdserve.scheduler.req import Req

logger = logging.getLogger(__name__)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class SlotFollower(Protocol):
    """A per-slot pool that moves with the target KV (the draft features)."""

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class PoolGeometry:
    """What a rank's KV bookkeeping is sized by: nothing of the model runner is needed
    to build it (the runner binds the pools it gets afterwards)."""
    num_pages: int          # the padding page included
    page_size: int
    num_layers: int
    num_kv_heads: int       # this rank's
    head_dim: int
    kv_dtype: torch.dtype
    device: torch.device
    max_running_requests: int
    max_positions: int      # the context length plus the decode strategy's lookahead
    radix_cache: bool = True
    kv_scales: KVScales | None = None        # fp8 KV: per-layer scales (None: 1.0)
    compute_dtype: torch.dtype | None = None  # what an fp8 pool's reads dequantise to

    @staticmethod
    def of(args: ServerArgs, runner: ModelRunner, num_pages: int, lookahead: int) -> "PoolGeometry":
        # A speculative round's tree may reach past the context end; those positions
        # are never committed (a request finishes at the context length).
        cfg = runner.config
        return PoolGeometry(num_pages, args.page_size, cfg.num_layers, runner.num_local_kv_heads, cfg.head_dim,
                            runner.kv_dtype, runner.device, args.max_running_requests,
                            runner.context_len + lookahead, radix_cache=not args.disable_radix_cache,
                            kv_scales=runner.kv_scales, compute_dtype=runner.dtype)


class KVManager:
    def __init__(self, geometry: PoolGeometry) -> None:
        g = geometry
        self.device = g.device
        self.page_size = g.page_size
        self.allocator = PageAllocator(g.num_pages, g.page_size)
        self.num_slots = g.num_pages * g.page_size
        self.kv_pool = TokenToKVPool("target", g.num_layers, self.num_slots, g.num_kv_heads, g.head_dim,
                                     g.kv_dtype, g.device, g.kv_scales, g.compute_dtype)
        self.req_table = ReqToTokenPool(g.max_running_requests, g.max_positions, g.device)
        self.cache: RadixCache | ChunkCache = (
            RadixCache(self.allocator) if g.radix_cache else ChunkCache(self.allocator))
        self.followers: list[SlotFollower] = []
        # Open speculative rounds by table row: (kv_len when it opened, its new page ids).
        self._rounds: dict[int, tuple[int, list[int]]] = {}

    def bind(self, runner: ModelRunner) -> None:
        """Give the runner the pools its forwards read and write (it builds its attention
        backend over them; CUDA graphs are captured afterwards, by the scheduler's builder)."""
        runner.bind_memory(self.kv_pool, self.req_table.table, self.num_slots, self.req_table.padding_row)

    # ---- capacity -----------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get now: free ones and unlocked cached ones."""
        return self.allocator.num_free + self.cache.evictable_pages

    @property
    def free_rows(self) -> int:
        return self.req_table.num_free

    def growth_pages(self, req: Req, extra: int) -> int:
        """Pages ``req`` needs to hold ``extra`` more positions."""
        return pages_for(req.kv_len + extra, self.page_size) - pages_for(req.kv_len, self.page_size)

    # ---- prefixes -------------------------------------------------------------------
    def match(self, ids: list[int]) -> PrefixMatch:
        """The longest cached prefix of ``ids``, locked until attached or unlocked."""
        match = self.cache.match_prefix(ids)
        self.cache.lock(match.node)
        return match

    def unlock(self, match: PrefixMatch) -> None:
        self.cache.unlock(match.node)

    def matched_len(self, ids: list[int]) -> int:
        return self.cache.match_prefix(ids).slots.numel()

    def attach(self, req: Req, match: PrefixMatch) -> int:
        """Give a waiting request (and its pending forks) table rows and the matched
        prefix; returns the number of cached positions."""
        req.row = self.req_table.alloc()
        for child in req.pending_forks:
            child.row = self.req_table.alloc()
        n = match.slots.numel()
        if n:
            self.req_table.table[req.row, :n] = match.slots.to(self.device)
            self.allocator.retain(match.slots[::self.page_size] // self.page_size)
        req.lock_node = match.node
        req.kv_len = n
        req.draft_len = 0  # the draft KV of a cached prefix is recomputed from its stored features
        return n

    # ---- slots ------------------------------------------------------------------------
    def alloc_pages(self, n: int) -> torch.Tensor:
        return torch.tensor(self.alloc_page_ids(n), dtype=torch.int64)

    def alloc_page_ids(self, n: int, contiguous: bool = False) -> list[int]:
        """``n`` pages (evicting cached prefixes as needed); ``contiguous``: in the fewest
        runs of consecutive pages (a prompt's or a transfer's KV: see PageAllocator)."""
        while self.allocator.num_free < n:
            if self.cache.evict(n - self.allocator.num_free) == 0:
                # Admission and decode-room checks make this unreachable; if it is
                # reached, the accounting is wrong and must not be papered over.
                raise RuntimeError(f"KV accounting error: need {n} pages, {self.allocator.num_free} free, "
                                   f"{self.cache.evictable_pages} reported evictable")
        return self.allocator.alloc_ids(n, contiguous)

    def assign(self, req: Req, start: int, end: int) -> list[int]:
        """Give positions [start, end) of ``req`` (a prompt's chunk, a transfer's KV) KV
        slots, continuing its last page, then in consecutive pages where the pool has
        them; returns the new pages' ids."""
        return self.assign_many([req], [start], [end], contiguous=True)[0]

    def open_rounds(self, reqs: list[Req], lookahead: int) -> list[list[int]]:
        """Positions [kv_len, kv_len + lookahead) of every request get slots (a speculative
        round: its tree and draft scratch). The round stays open, its new pages on
        record, until ``close_rounds`` keeps what the request's length then needs, or
        ``release`` ends the request: no path out of a round leaks its pages. Returns
        each request's new page ids."""
        starts = [r.kv_len for r in reqs]
        new_pages = self.assign_many(reqs, starts, [n + lookahead for n in starts])
        for req, start, pages in zip(reqs, starts, new_pages):
            assert req.row is not None and req.row not in self._rounds, "a round is already open"
            self._rounds[req.row] = (start, pages)
        return new_pages

    def close_rounds(self, reqs: list[Req]) -> None:
        """Give back each request's round pages past its ``kv_len`` now (the host's
        ids: no device read), in one release."""
        ps = self.page_size
        drop: list[int] = []
        for req in reqs:
            if req.row is None or req.row not in self._rounds:
                continue
            start, pages = self._rounds.pop(req.row)
            keep = max(0, pages_for(req.kv_len, ps) - pages_for(start, ps))
            drop += pages[keep:]
        if drop:
            self.allocator.release(torch.tensor(drop, dtype=torch.int64))

    def assign_many(self, reqs: list[Req], starts: list[int], ends: list[int],
                    contiguous: bool = False) -> list[list[int]]:
        """Give each request's positions [start, end) KV slots, continuing its last page
        (the slots after position start - 1's), then in new pages (``contiguous``: taken
        as the fewest runs of consecutive pages, each request's in order). The page
        choices are made on the host per request and go up in one upload; the positions
        are expanded on the device. Returns each request's new page ids."""
        ps, b = self.page_size, len(reqs)
        counts = [pages_for(e, ps) - pages_for(s, ps) for s, e in zip(starts, ends)]
        ids = self.alloc_page_ids(sum(counts), contiguous)
        new_pages, page_base, at = [], [], 0
        for c in counts:
            new_pages.append(ids[at: at + c])
            page_base.append(at)
            at += c
        rows = []
        for req in reqs:
            assert req.row is not None
            rows.append(req.row)
        lengths = [e - s for s, e in zip(starts, ends)]
        total = sum(lengths)
        # One upload: per request (row, start, length, first new page's index), then the
        # new page ids (plus a 0, so a request without new pages still gathers in range).
        packed = upload(rows + starts + lengths + page_base + ids + [0], torch.int64, self.device)
        row_t, start_t, length_t, base_t = packed[: 4 * b].view(4, b)
        page_ids = packed[4 * b:]
        owner = torch.repeat_interleave(torch.arange(b, device=self.device), length_t, output_size=total)
        first = torch.cumsum(length_t, 0) - length_t
        pos = start_t[owner] + torch.arange(total, device=self.device) - first[owner]
        row, last = row_t[owner], start_t[owner] - 1
        first_new = (start_t[owner] + ps - 1) // ps * ps  # the first position of the first new page
        page = page_ids[(base_t[owner] + (pos - first_new).div(ps, rounding_mode="floor")).clamp(0, len(ids))]
        table = self.req_table.table
        following = table[row, last.clamp(min=0)] + (pos - last)
        table[row, pos] = torch.where(pos >= first_new, page * ps + pos % ps, following)
        return new_pages

    def reserve(self, req: Req, length: int, prefix: PrefixMatch | None = None) -> list[int]:
        """A row, the cached ``prefix`` (locked by ``match``; none: nothing cached) and
        slots for the positions after it up to ``length``, of a request whose KV there
        will be written from outside (a transfer); returns those slots."""
        if prefix is not None:
            start = self.attach(req, prefix)
        else:
            req.row, start = self.req_table.alloc(), 0
        self.assign(req, start, length)
        req.kv_len = length
        return self.slots(req, start, length)

    def slots(self, req: Req, start: int, end: int) -> list[int]:
        assert req.row is not None
        return self.req_table.table[req.row, start:end].tolist()

    def grow_by_one(self, reqs: list[Req], layout: RowLayout) -> None:
        """One more slot for each request (a decode step) at position ``r.kv_len``;
        ``layout`` holds the same rows and positions on the device. Page choices are
        made on the host and go up in one upload: no device read."""
        ps = self.page_size
        rows, pos = layout.rows, layout.prefix_lens
        needs_page = [r.kv_len % ps == 0 for r in reqs]
        pages = iter(self.alloc_page_ids(sum(needs_page)))
        # Per row: the first slot of its new page, or 0 where it continues its last page.
        new_slot = upload([next(pages) * ps if needed else 0 for needed in needs_page], torch.int64, self.device)
        if ps == 1:
            slots = new_slot
        else:
            following = self.req_table.table[rows, (pos - 1).clamp(min=0)] + 1
            slots = torch.where(new_slot > 0, new_slot, following)
        self.req_table.table[rows, pos] = slots

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.kv_pool.copy_slots(dst, src)
        for f in self.followers:
            f.copy_slots(dst, src)

    def move_positions(self, moves: list[tuple[int, int, int]]) -> None:
        """Copy the KV of position ``src`` to position ``dst`` of row ``row`` for each
        ``(row, dst, src)`` (speculative rounds keeping their accepted paths; rows never
        share slots, so one batched copy serves every request)."""
        if not moves:
            return
        rows, dsts, srcs = upload([x for move in moves for x in move], torch.int64, self.device).view(-1, 3).unbind(1)
        table = self.req_table.table
        self.copy_slots(table[rows, dsts], table[rows, srcs])

    def fork(self, parent: Req, children: list[Req], own_last_position: bool) -> None:
        """Start ``children`` on the parent's prompt KV: full pages are shared, a partial
        last page is copied (each sample writes its own continuation). With
        ``own_last_position`` the last prompt position always lives in a page of each
        sample's own (its draft KV depends on the sample's first token)."""
        ps, n = self.page_size, parent.kv_len
        full = (n - 1) // ps * ps if own_last_position else n // ps * ps
        shared = self.req_table.table[parent.row, :full]
        # Cache the prompt now and lock it for every sample: whichever sample
        # finishes first must not leave shared pages counted as evictable.
        self.cache.insert(parent.fill_ids[:full], shared.cpu())
        prompt_node = self.cache.match_prefix(parent.fill_ids[:full]).node
        self.cache.lock(prompt_node)
        self.cache.unlock(parent.lock_node)
        parent.lock_node = prompt_node
        for child in children:
            assert child.row is not None
            self.req_table.table[child.row, :full] = shared
            self.allocator.retain(shared[::ps].cpu() // ps)
            if full < n:
                page = self.alloc_pages(1).to(self.device)
                dst = page * ps + torch.arange(n - full, device=self.device)
                self.copy_slots(dst, self.req_table.table[parent.row, full:n])
                self.req_table.table[child.row, full:n] = dst
            child.kv_len = n
            child.draft_len = 0
            child.cached_tokens = parent.cached_tokens
            child.lock_node = prompt_node
            self.cache.lock(prompt_node)

    # ---- releasing ------------------------------------------------------------------------
    def release(self, req: Req, cache_kv: bool) -> None:
        """Give back everything ``req`` holds (its KV into the prefix cache when
        ``cache_kv``); its never-forked samples' rows too."""
        for child in req.pending_forks:
            if child.row is not None:
                self.req_table.free(child.row)
                child.row = None
        if req.row is None:
            return
        self.close_rounds([req])  # a round it was in: the pages past its length
        if req.kv_len:
            slots = self.req_table.table[req.row, :req.kv_len].cpu()
            if cache_kv:
                self.cache.insert(req.fill_ids[:req.kv_len], slots)
            self.allocator.release(slots[::self.page_size] // self.page_size)
        self.cache.unlock(req.lock_node)
        req.lock_node = None
        self.req_table.free(req.row)
        req.row = None
        req.kv_len = 0

    def hold(self, req: Req, start: int = 0) -> torch.Tensor:
        """One more reference on ``req``'s pages from position ``start`` (page aligned)
        on, released later with ``drop``: what a failed transfer keeps out of use while a
        late write may still land there (a cached prefix before ``start`` is never written)."""
        ps = self.page_size
        pages = self.req_table.table[req.row, start: req.kv_len: ps].cpu() // ps
        self.allocator.retain(pages)
        return pages

    def drop(self, pages: torch.Tensor) -> None:
        self.allocator.release(pages)

    def flush(self) -> None:
        self.cache.reset()

    def memory_state(self) -> dict[str, int]:
        return {
            "kv_pages_total": self.allocator.capacity,
            "kv_pages_free": self.allocator.num_free,
            "kv_pages_evictable": self.cache.evictable_pages,
            "req_slots_total": self.req_table.num_rows,
            "req_slots_free": self.req_table.num_free,
        }
