"""A prefill rank's gather buffer: what it sends into a decode rank's landing piece in many
small entries, it first copies into one registered host buffer, and sends from there in
one entry per buffer.

A landing piece (``landing.py``) makes the destination of a request consecutive; the
source may still be short runs: a prefill pool that cached prefixes long ago, or a pair
that sends only some heads of every source slot (decode at a higher TP than prefill:
each of its ranks holds fewer heads, a strided part of each prefill slot, one entry per
position otherwise). For each pair whose entries would average less than
``GATHER_BELOW_ENTRY_BYTES``, the transfer thread copies the rows (their heads) into the
buffer, packed as the landing region holds them, and writes the buffer; the engines pay
per entry, a memory copy per byte. Pieces that do not fit are gathered and written in
turn (each write completes before the buffer is reused: ``TransferEngine.write`` waits).

Only host memory is gathered (a CPU server, or the host copies of ``--disaggregation-kv-
staging host``): device buffers an engine writes directly are sent as planned.
"""

from __future__ import annotations

import threading
from typing import Iterator, Sequence

import numpy as np
import torch

from pdserve.disagg.landing import slot_runs
from pdserve.disagg.layout import BufferPair, BufferSpec, TransferPlan
from pdserve.disagg.transfer import WriteBatch, coalesce

GATHER_BYTES = 32 << 20
# A pair is gathered when its entries would average fewer bytes than this: on loopback
# TCP an engine's entry costs about as much as copying 64 KiB (docs/benchmarks.md).
GATHER_BELOW_ENTRY_BYTES = 64 << 10


class SourceRows:
    """The host tensors a prefill rank sends from, found by a buffer's address."""

    def __init__(self) -> None:
        self._by_ptr: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()  # (features are added on the handshake thread)

    def add(self, t: torch.Tensor) -> None:
        if t.device.type == "cpu":
            with self._lock:
                self._by_ptr[t.data_ptr()] = t

    def rows(self, spec: BufferSpec) -> np.ndarray | None:
        """``spec``'s memory as one row of bytes per slot, or None (not host memory
        this rank knows)."""
        with self._lock:
            t = self._by_ptr.get(spec.ptr)
        if t is None or t.numel() * t.element_size() != spec.num_slots * spec.slot_bytes:
            return None
        return t.reshape(t.shape[0], -1).view(torch.uint8).numpy().reshape(spec.num_slots, spec.slot_bytes)


class SourceGather:
    """One rank's gather buffer (``nbytes``, allocated and registered with ``engine`` at
    its first use) and the source rows it copies from. Used by the transfer thread only."""

    def __init__(self, engine: object, sources: SourceRows, nbytes: int = GATHER_BYTES,
                 below: int = GATHER_BELOW_ENTRY_BYTES) -> None:
        self.engine, self.sources, self.nbytes, self.below = engine, sources, nbytes, below
        self._buffer: torch.Tensor | None = None
        self.gathered_bytes = 0  # sent from the buffer, over the rank's life

    def split(self, plan: TransferPlan, src_slots: Sequence[int], dst: Sequence[int]
              ) -> tuple[WriteBatch, list[BufferPair]]:
        """``plan``'s writes of ``src_slots`` to ``dst`` (consecutive positions of a landing
        piece) that go as planned, and the pairs worth gathering instead (their source is
        host memory this rank knows; one position of all of them fits the buffer). Call
        ``batches`` with those of one split only."""
        # Entries as planned, counted without building them: the destination (a landing
        # region) is consecutive, so a pair that moves whole slots writes one entry per run
        # of source slots, any other one per position.
        runs = slot_runs(src_slots)
        planned: list[BufferPair] = []
        gathered: list[BufferPair] = []
        per_position = 0  # of the pairs gathered: a position of each must fit the buffer
        for p in plan.pairs:
            entries = runs if p.whole_slots else len(src_slots)
            if (entries > 1 and len(src_slots) * p.length < self.below * entries
                    and per_position + p.length <= self.nbytes and self.sources.rows(p.src) is not None):
                gathered.append(p)
                per_position += p.length
            else:
                planned.append(p)
        return TransferPlan(tuple(planned)).writes(src_slots, dst), gathered

    def batches(self, pairs: Sequence[BufferPair], src_slots: Sequence[int], dst: Sequence[int]
                ) -> Iterator[WriteBatch]:
        """The writes of ``pairs`` for ``src_slots`` to ``dst``, from the gather buffer: one
        batch per piece of positions that fits, each to be written (and waited for) before
        the next is asked for."""
        if not pairs or not len(src_slots):
            return
        buf = self._host_buffer()
        base = buf.data_ptr()
        view = buf.numpy()
        per_position = sum(p.length for p in pairs)
        step = max(1, self.nbytes // per_position)
        for start in range(0, len(src_slots), step):
            idx = np.asarray(src_slots[start:start + step], dtype=np.int64)
            at = 0
            srcs: list[int] = []
            dsts: list[int] = []
            lens: list[int] = []
            for p in pairs:
                rows = self.sources.rows(p.src)
                assert rows is not None  # (split chose only these)
                n = len(idx) * p.length
                view[at:at + n].reshape(len(idx), p.length)[:] = rows[idx, p.src_offset:p.src_offset + p.length]
                part = coalesce([base + at + i * p.length for i in range(len(idx))],
                                [p.dst.ptr + d * p.dst.slot_bytes + p.dst_offset for d in dst[start:start + len(idx)]],
                                p.length)
                srcs += part.src
                dsts += part.dst
                lens += part.lengths
                at += n
            self.gathered_bytes += at
            yield WriteBatch(tuple(srcs), tuple(dsts), tuple(lens))

    def _host_buffer(self) -> torch.Tensor:
        if self._buffer is None:
            buf = torch.zeros(self.nbytes, dtype=torch.uint8)  # (touched: no page faults inside a write)
            self.engine.register(buf.data_ptr(), self.nbytes)  # type: ignore[attr-defined]
            self._buffer = buf
        return self._buffer
