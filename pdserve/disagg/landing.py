"""A decode rank's landing area: where a request whose destination slots are scattered
receives its KV in a few large writes, copied into its slots at commit.

A transfer writes one entry per run of slots consecutive on both sides
(``TransferPlan.writes``). A prefill server's pool is churned by prompts only and hands
out long runs (``PageAllocator.alloc_ids(contiguous=True)``), but a decode server's pool
is also grown one page per request per step: at a small page size and a high fill its
free slots are short holes, and a reserve made of them means thousands of small writes,
where the engines' per-entry cost dominates (docs/benchmarks.md). So decode may give such a
request a piece of its landing area instead: one registered, contiguous block in which
the request's positions are packed, buffer by buffer (``landing_regions``), each position
of a buffer one row of the heads this rank receives. The sender writes its runs there
as it would into slots (``TransferPlan.landed``), so a chunk of a prompt is one entry per
buffer, and decode copies the rows into the reserved slots (``LandingArea.unpack``, one
gather-free copy per buffer) before the request's first step, like the host staging
path's ``stage_in``.

The area is a byte range with first-fit extents. A request takes its piece when it is
admitted and gives it back when its KV is committed, or, after a failure, together with
its quarantined pages (a late write may still land in it). A request that does not fit
(the area is busy, or it is larger than the area) is written into its slots directly,
as before: landing is an optimisation, never a wait.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from pdserve.disagg.layout import BufferSpec, HeadRange, KVLayout, sender_heads

LANDING_BUFFER = "landing"
# A request lands when its destination slots average fewer positions per run than this:
# at 64 positions of 512 bytes or more per buffer, an entry is 32 KiB or more and the
# engines move it near their contiguous speed (docs/benchmarks.md, the page-size table).
LANDING_MIN_RUN = 64
# Each request's piece starts on this boundary (a page: cheap copies, aligned RDMA).
LANDING_ALIGN = 4096


# The default landing area: this share of the rank's transfer buffers, within bounds.
LANDING_POOL_SHARE = 1 / 32
LANDING_DEFAULT_BYTES = (16 << 20, 512 << 20)


def landing_bytes(mib: int | None, pool_bytes: int) -> int:
    """The landing area's size for ``--disaggregation-kv-landing-mib mib`` (None: the
    default share of ``pool_bytes``, the rank's transfer buffers, within bounds; 0: none)."""
    if mib is not None:
        return mib << 20
    low, high = LANDING_DEFAULT_BYTES
    share = int(pool_bytes * LANDING_POOL_SHARE) // LANDING_ALIGN * LANDING_ALIGN
    return min(max(share, low), high)


@dataclass(frozen=True)
class LandingRegion:
    """Where one destination buffer's rows of a request sit in its landing piece."""
    name: str
    offset: int      # bytes from the piece's start to this buffer's first row
    row_bytes: int   # bytes one position brings to this buffer (the heads this rank receives)
    skip: int        # bytes into a destination slot where that row goes


def landing_names(wanted: Sequence[str], want_features: bool, want_draft_state: bool) -> tuple[str, ...]:
    """The buffers of decode's ``wanted`` (its handshake's, in that order) a request
    receives: the target KV always, the features or the draft KV as it asked."""
    def receives(name: str) -> bool:
        if name == "features":
            return want_features
        if name.startswith("draft."):
            return want_draft_state
        return True
    return tuple(n for n in wanted if receives(n))


def landing_regions(layout: KVLayout, names: Sequence[str], positions: int,
                    senders: Mapping[str, Sequence[HeadRange]] | None = None
                    ) -> tuple[tuple[LandingRegion, ...], int]:
    """The regions of a piece holding ``positions`` positions of the buffers ``names``
    of decode's ``layout``, and the piece's size in bytes. Both sides compute it: prefill
    to address its writes, decode to size the piece and unpack it.

    A buffer's received heads are cut into one region per prefill rank that sends some of
    them (``senders``: each head-sharded buffer's heads on every prefill rank, in rank
    order; a buffer not in it has one sender), so what one prefill rank sends for
    consecutive positions is consecutive in the piece, also when several ranks fill one
    slot (prefill at a higher TP than decode)."""
    if positions < 0:
        raise ValueError(f"a landing piece holds a non-negative number of positions, got {positions}")
    specs = layout.by_name()
    regions = []
    offset = 0
    for name in names:
        for row, skip in _sender_parts(specs[name], (senders or {}).get(name)):
            regions.append(LandingRegion(name, offset, row, skip))
            offset += positions * row
    return tuple(regions), offset


def _sender_parts(spec: BufferSpec, ranks: Sequence[HeadRange] | None) -> list[tuple[int, int]]:
    """(bytes, offset into a slot) of each part of ``spec``'s received heads that one
    prefill rank sends, in head order; the whole received row when it has one sender."""
    if spec.heads is None:
        return [(spec.slot_bytes, 0)]
    wanted = spec.receives or spec.heads
    hb = spec.head_bytes
    parts = [sender_heads(ranks, r, wanted) for r in range(len(ranks))] if ranks else [wanted]
    return sorted(((p.count * hb, (p.start - spec.heads.start) * hb) for p in parts if p is not None),
                  key=lambda part: part[1])


def slot_runs(slots: Sequence[int]) -> int:
    """Runs of consecutive slots in ``slots`` (in order)."""
    if not len(slots):
        return 0
    return 1 + sum(1 for a, b in zip(slots, slots[1:]) if b != a + 1)


def worth_landing(slots: Sequence[int], min_run: int = LANDING_MIN_RUN) -> bool:
    """Whether a request with destination ``slots`` should land: they average fewer than
    ``min_run`` positions per run of consecutive slots."""
    return len(slots) > 1 and slot_runs(slots) * min_run > len(slots)


def strided_source(layout: KVLayout, names: Sequence[str], senders: Mapping[str, Sequence[HeadRange]]) -> bool:
    """Whether some prefill rank sends this decode rank only part of the heads of each of
    its slots (decode at a higher TP): written as planned that is one entry per position,
    whatever the slots; landed, the prefill rank gathers it into a few (``gather.py``)."""
    specs = layout.by_name()
    for name in names:
        ranks, spec = senders.get(name), specs[name]
        if not ranks or spec.heads is None:
            continue
        wanted = spec.receives or spec.heads
        for r, held in enumerate(ranks):
            sent = sender_heads(ranks, r, wanted)
            if sent is not None and sent.count < held.count:
                return True
    return False


def _raw_rows(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage as one row of bytes per slot (its first dimension)."""
    return t.reshape(t.shape[0], -1).view(torch.uint8)


# Copies move the widest words every offset and length of a region allows: a copy of
# uint8 rows runs about 5x slower than the same bytes as int64 on a CPU.
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word(*sizes: int) -> tuple[int, torch.dtype]:
    return next((n, dtype) for n, dtype in _WORDS if all(s % n == 0 for s in sizes))


class LandingArea:
    """One rank's landing buffer (``nbytes`` on ``device``) and its free extents. Used from
    the scheduler thread only: pieces are taken at admission and given back at commit or
    when a failed request's pages are freed."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        if nbytes < LANDING_ALIGN:
            raise ValueError(f"a landing area needs at least {LANDING_ALIGN} bytes, got {nbytes}")
        # Written before registration: a CPU engine reading never-touched pages would map
        # the shared zero page, and the first write into each would fault inside a transfer.
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.capacity = nbytes
        self._free_starts = [0]          # free extents, sorted by start
        self._free_ends = {0: nbytes}    # start -> end
        self._taken: dict[int, int] = {}  # start -> end of each piece handed out

    @property
    def spec(self) -> BufferSpec:
        """The buffer as the engine registers it and the handshake publishes it."""
        return BufferSpec(LANDING_BUFFER, self.buffer.data_ptr(), self.capacity, 1)

    @property
    def free_bytes(self) -> int:
        return sum(end - start for start, end in self._free_ends.items())

    @property
    def pieces(self) -> int:
        return len(self._taken)

    def take(self, nbytes: int) -> int | None:
        """The offset of a free piece of ``nbytes`` (first fit), or None when none is free."""
        if nbytes <= 0:
            raise ValueError(f"a landing piece needs a positive size, got {nbytes}")
        size = -(-nbytes // LANDING_ALIGN) * LANDING_ALIGN
        for start in self._free_starts:
            end = self._free_ends[start]
            if end - start >= size:
                self._free_starts.remove(start)
                del self._free_ends[start]
                if end - start > size:
                    bisect.insort(self._free_starts, start + size)
                    self._free_ends[start + size] = end
                self._taken[start] = start + size
                return start
        return None

    def give(self, offset: int) -> None:
        """Give back the piece at ``offset`` (merged with its free neighbours)."""
        end = self._taken.pop(offset)  # KeyError: not a piece of this area (a bug)
        start = offset
        i = bisect.bisect_left(self._free_starts, start)
        if i < len(self._free_starts) and self._free_starts[i] == end:  # the next extent
            nxt = self._free_starts.pop(i)
            end = self._free_ends.pop(nxt)
        if i > 0 and self._free_ends[self._free_starts[i - 1]] == start:  # the previous one
            start = self._free_starts[i - 1]
        else:
            self._free_starts.insert(i, start)
        self._free_ends[start] = end

    def unpack(self, offset: int, regions: Sequence[LandingRegion], slots: Sequence[int],
               buffers: Mapping[str, torch.Tensor]) -> None:
        """Copy a landed request into its slots: position i of every region into slot
        ``slots[i]`` of the buffer of that name, at the region's ``skip``."""
        n = len(slots)
        if not n:
            return
        index: dict[torch.device, torch.Tensor] = {}
        np_index = functools.cache(lambda: np.asarray(slots, dtype=np.int64))
        for r in regions:
            target = _raw_rows(buffers[r.name])
            start = offset + r.offset
            size, dtype = _word(start, r.row_bytes, r.skip, target.shape[1])
            rows = self.buffer[start: start + n * r.row_bytes].view(dtype).view(n, r.row_bytes // size)
            target = target.view(dtype)
            lo, hi = r.skip // size, (r.skip + r.row_bytes) // size
            if target.device.type == "cpu" and rows.device.type == "cpu":
                # numpy's row copies: 3-4x torch's index_copy_ on a CPU, which also stalls
                # when its threads compete with the server's for the cores.
                target.numpy()[np_index(), lo:hi] = rows.numpy()
                continue
            # (A blocking copy: the piece is given back, and may be written again, right after.)
            rows = rows.to(target.device)
            idx = index.get(target.device)
            if idx is None:
                idx = index[target.device] = torch.tensor(list(slots), dtype=torch.int64).to(target.device)
            if lo == 0 and hi == target.shape[1]:
                target.index_copy_(0, idx, rows)
            else:
                target[idx, lo:hi] = rows
