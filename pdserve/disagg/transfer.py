"""KV transfer engines behind one small interface: register memory, write a batch.

``MooncakeTransfer`` wraps Mooncake's TransferEngine (TCP here, RDMA when an IB
device is named); peers address each other by session id ``host:rpc_port``,
exchanged out of band (bootstrap / handshake).  Writes are one-sided: the
sender names the receiver's addresses, which the receiver registered and
published.

Mooncake's TCP transport fails a batch of more than ~2048 entries ("TCP lane
queue-full") and can poison the peer for a while, so batches are split at
``MAX_BATCH_ENTRIES``; callers coalesce contiguous pages before that.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Protocol, Sequence

logger = logging.getLogger(__name__)

MAX_BATCH_ENTRIES = 1024


class TransferError(RuntimeError):
    """A write failed; the message says which peer and why."""


@dataclass(frozen=True)
class WriteBatch:
    src: tuple[int, ...]
    dst: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.src) == len(self.dst) == len(self.lengths):
            raise ValueError("a write batch needs as many destinations and lengths as sources")

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)


class TransferEngine(Protocol):
    session_id: str

    def register(self, ptr: int, length: int) -> None: ...

    def write(self, peer_session: str, batch: WriteBatch) -> None: ...

    def close(self) -> None: ...


def split_batch(batch: WriteBatch, cap: int = MAX_BATCH_ENTRIES) -> list[WriteBatch]:
    return [WriteBatch(batch.src[i:i + cap], batch.dst[i:i + cap], batch.lengths[i:i + cap])
            for i in range(0, len(batch.src), cap)]


class MooncakeTransfer:
    """Mooncake TransferEngine; ``device`` = an IB device name for RDMA, "" for TCP."""

    def __init__(self, host: str, device: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine as _Engine
        except ImportError as exc:  # the wheel or libibverbs1 is missing
            raise TransferError(
                "--disaggregation-transfer-backend mooncake needs the `mooncake-transfer-engine` package "
                "(`mooncake-transfer-engine-non-cuda` on CPU) and Debian's libibverbs1: " + str(exc)) from None
        self._engine = _Engine()
        protocol = "rdma" if device else "tcp"
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host!r}, {protocol}, {device!r}) failed with {rc}")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def register(self, ptr: int, length: int) -> None:
        with self._lock:
            if (ptr, length) in self._registered:
                return
            rc = self._engine.register_memory(ptr, length)
            if rc != 0:
                raise TransferError(f"Mooncake register_memory({ptr:#x}, {length}) failed with {rc}")
            self._registered.add((ptr, length))

    def write(self, peer_session: str, batch: WriteBatch) -> None:
        for part in split_batch(batch):
            rc = self._engine.batch_transfer_sync_write(peer_session, list(part.src), list(part.dst),
                                                        list(part.lengths))
            if rc < 0:
                raise TransferError(f"Mooncake write of {len(part.src)} entries ({part.nbytes} bytes) to "
                                    f"{peer_session} failed with {rc}")

    def close(self) -> None:
        with self._lock:
            for ptr, _ in self._registered:
                self._engine.unregister_memory(ptr)
            self._registered.clear()


class LocalTransfer:
    """Same-process memcpy with the engine interface: lets tests run the protocol and
    the transfer plan without a network (peers must live in this process)."""

    def __init__(self, name: str = "local") -> None:
        self.session_id = name
        self.bytes_written = 0

    def register(self, ptr: int, length: int) -> None:
        pass

    def write(self, peer_session: str, batch: WriteBatch) -> None:
        import ctypes

        for s, d, n in zip(batch.src, batch.dst, batch.lengths):
            ctypes.memmove(d, s, n)
        self.bytes_written += batch.nbytes

    def close(self) -> None:
        pass


def coalesce(src: Sequence[int], dst: Sequence[int], length: int) -> WriteBatch:
    """Merge runs where both source and destination addresses advance by ``length``
    into single entries (contiguous pages become one write)."""
    out_s: list[int] = []
    out_d: list[int] = []
    out_l: list[int] = []
    for s, d in zip(src, dst):
        if out_s and out_s[-1] + out_l[-1] == s and out_d[-1] + out_l[-1] == d:
            out_l[-1] += length
        else:
            out_s.append(s)
            out_d.append(d)
            out_l.append(length)
    return WriteBatch(tuple(out_s), tuple(out_d), tuple(out_l))
