"""KV transfer engines behind one small interface: register memory, write a batch.

``MooncakeTransfer`` wraps Mooncake's TransferEngine (TCP here, RDMA when an IB
device is named); peers address each other by session id ``host:rpc_port``,
exchanged out of band (bootstrap / handshake).  Writes are one-sided: the
sender names the receiver's addresses, which the receiver registered and
published.

Mooncake's TCP transport fails a batch of more than ~2048 entries ("TCP lane
queue-full") and can poison the peer for a while, so batches are split at
``MAX_BATCH_ENTRIES``; callers coalesce contiguous pages before that.

Mooncake logs through glog, to stderr, at its own level: every normal start prints a
dozen INFO / WARNING lines and an ERROR ("Local segment descriptor not found") that
mean nothing is wrong. Its level follows the server's --log-level instead
(`mooncake_log_level`): everything at `debug`; otherwise its errors only, and none
during `initialize` (where that line comes from; a failed initialize is reported by
pdserve with its return code). An MC_LOG_LEVEL the user set wins.

Servers pick their engine by name through ``engines.py`` (the registry): each engine
class here declares its ``capabilities()`` and how it is built (``from_settings``).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from pdserve.disagg.engines import EngineCapabilities, EngineSettings

logger = logging.getLogger(__name__)

MAX_BATCH_ENTRIES = 1024

# glog severities (FLAGS_minloglevel: messages below it are dropped).
GLOG_INFO, GLOG_WARNING, GLOG_ERROR, GLOG_FATAL = 0, 1, 2, 3
# glog's FLAGS_minloglevel (gflags' `fLI` namespace), in the library that links glog.
_GLOG_MINLOGLEVEL_SYMBOL = "_ZN3fLI17FLAGS_minloglevelE"


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
    """What the transfer managers use. A class registered in ``engines.py`` also has the
    classmethods ``capabilities() -> EngineCapabilities`` and ``from_settings(settings)``."""

    session_id: str
    # Whether register/write work on device (GPU) memory; when not, the KV is staged
    # through host copies on a GPU (``choose_staging``). As the class's capabilities() say.
    reaches_device_memory: bool

    def register(self, ptr: int, length: int) -> None: ...

    def metadata(self) -> str:
        """What a peer needs to write into this engine's registered memory, sent in the
        handshake ("" when the session id is enough, as for Mooncake)."""
        ...

    def add_peer(self, session_id: str, metadata: str) -> None:
        """Load a peer's ``metadata()`` before writing to it (TransferError if unusable)."""
        ...

    def remove_peer(self, session_id: str) -> None: ...

    def write(self, peer_session: str, batch: WriteBatch) -> None: ...

    def close(self) -> None: ...


def split_batch(batch: WriteBatch, cap: int = MAX_BATCH_ENTRIES) -> list[WriteBatch]:
    return [WriteBatch(batch.src[i:i + cap], batch.dst[i:i + cap], batch.lengths[i:i + cap])
            for i in range(0, len(batch.src), cap)]


def split_entries(batch: WriteBatch, max_entry_bytes: int | None) -> WriteBatch:
    """``batch`` with every entry longer than ``max_entry_bytes`` cut into consecutive
    pieces of at most that many bytes (None: as it is)."""
    if max_entry_bytes is None or all(n <= max_entry_bytes for n in batch.lengths):
        return batch
    if max_entry_bytes <= 0:
        raise ValueError(f"max_entry_bytes must be positive, got {max_entry_bytes}")
    src: list[int] = []
    dst: list[int] = []
    lengths: list[int] = []
    for s, d, n in zip(batch.src, batch.dst, batch.lengths):
        for at in range(0, n, max_entry_bytes):
            src.append(s + at)
            dst.append(d + at)
            lengths.append(min(max_entry_bytes, n - at))
    return WriteBatch(tuple(src), tuple(dst), tuple(lengths))


def mooncake_log_level(log_level: str) -> int:
    """The glog threshold for Mooncake at a server --log-level: all of it at debug, its
    errors otherwise (its INFO / WARNING lines describe a normal start)."""
    return GLOG_INFO if log_level == "debug" else GLOG_ERROR


def _glog_threshold(module_file: str | None) -> ctypes.c_int | None:
    """glog's FLAGS_minloglevel as Mooncake's engine library sees it (None if that library
    does not export it: then only MC_LOG_LEVEL, read when the library loads, applies)."""
    if not module_file:
        return None
    try:
        return ctypes.c_int.in_dll(ctypes.CDLL(module_file), _GLOG_MINLOGLEVEL_SYMBOL)
    except (OSError, ValueError):
        return None


def mooncake_reaches_gpu_memory() -> bool:
    """Whether the installed Mooncake build can register GPU memory (the CUDA build is
    `mooncake-transfer-engine`; `mooncake-transfer-engine-non-cuda` cannot)."""
    try:
        importlib.metadata.version("mooncake-transfer-engine")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


class MooncakeTransfer:
    """Mooncake TransferEngine; ``device`` = an IB device name for RDMA, "" for TCP.
    ``log_level`` (the server's --log-level) sets how much of Mooncake's log shows."""

    # Entries above this are written in pieces: Mooncake's TCP transport moves one large
    # entry at about half a loopback socket's speed, and 512 KiB pieces at about its speed
    # (`python -m pdserve.bench.kv_transfer`, docs/benchmarks.md). None: no split.
    max_entry_bytes: int | None = 512 * 1024

    @classmethod
    def capabilities(cls) -> EngineCapabilities:
        """GPU memory only with Mooncake's CUDA build (read from the installed packages)."""
        return EngineCapabilities(
            reaches_device_memory=mooncake_reaches_gpu_memory(),
            device_memory_why_not="for Mooncake: its non-CUDA build, mooncake-transfer-engine-non-cuda, is installed",
            device_memory_remedy="install mooncake-transfer-engine (its CUDA build)")

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> "MooncakeTransfer":
        return cls(settings.host, settings.ib_device, log_level=settings.log_level)

    def __init__(self, host: str, device: str = "", log_level: str = "info") -> None:
        level = mooncake_log_level(log_level)
        user_level = "MC_LOG_LEVEL" in os.environ
        if not user_level:
            # Read when the library loads (its first import). Set for that moment only: left
            # in the environment, it would pass for the user's in the processes this one starts.
            os.environ["MC_LOG_LEVEL"] = "INFO" if level == GLOG_INFO else "ERROR"
        try:
            import mooncake.engine as _mooncake
            from mooncake.engine import TransferEngine as _Engine
        except ImportError as exc:  # the wheel or libibverbs1 is missing
            raise TransferError(
                "--disaggregation-transfer-backend mooncake needs the `mooncake-transfer-engine` package "
                "(`mooncake-transfer-engine-non-cuda` on CPU) and Debian's libibverbs1: " + str(exc)) from None
        finally:
            if not user_level:
                os.environ.pop("MC_LOG_LEVEL", None)
        threshold = None if user_level else _glog_threshold(getattr(_mooncake, "__file__", None))
        self._engine = _Engine()
        protocol = "rdma" if device else "tcp"
        if threshold is not None:
            # initialize's own lines (its "Local segment descriptor not found" ERROR included)
            # describe a normal start: shown only at debug.
            threshold.value = GLOG_INFO if level == GLOG_INFO else GLOG_FATAL
        try:
            rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        finally:
            if threshold is not None:
                threshold.value = level
        if rc != 0:
            hint = "" if level == GLOG_INFO else " (--log-level debug shows Mooncake's own messages)"
            raise TransferError(f"Mooncake initialize({host!r}, {protocol}, {device!r}) failed with {rc}{hint}")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self.reaches_device_memory = self.capabilities().reaches_device_memory
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

    def metadata(self) -> str:
        return ""  # peers find this engine by its session id (host:rpc_port)

    def add_peer(self, session_id: str, metadata: str) -> None:
        pass

    def remove_peer(self, session_id: str) -> None:
        pass

    def write(self, peer_session: str, batch: WriteBatch) -> None:
        for part in split_batch(split_entries(batch, self.max_entry_bytes)):
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
    the transfer plan without a network (peers must live in this process). Where CUDA
    is in use the copies go through ``cudaMemcpy`` (kind default: unified addressing
    tells host from device memory), so buffers may be GPU memory too."""

    @classmethod
    def capabilities(cls) -> EngineCapabilities:
        """Device memory wherever there is no CUDA, or CUDA is initialized (cudaMemcpy)."""
        import torch

        return EngineCapabilities(
            reaches_device_memory=not torch.cuda.is_available() or torch.cuda.is_initialized(),
            device_memory_why_not="LocalTransfer copies GPU memory only once CUDA is initialized",
            device_memory_remedy="initialize CUDA before building the engine")

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> "LocalTransfer":
        return cls(settings.host)

    def __init__(self, name: str = "local") -> None:
        import torch

        self.session_id = name
        self.bytes_written = 0
        cuda_copy = _cuda_memcpy()
        self._copy = cuda_copy or ctypes.memmove
        # memmove reaches device memory only where there is none (a CPU-only torch); with
        # CUDA present but not initialized yet, GPU pointers would crash it.
        self.reaches_device_memory = cuda_copy is not None or not torch.cuda.is_available()

    def register(self, ptr: int, length: int) -> None:
        pass

    def metadata(self) -> str:
        return ""

    def add_peer(self, session_id: str, metadata: str) -> None:
        pass

    def remove_peer(self, session_id: str) -> None:
        pass

    def write(self, peer_session: str, batch: WriteBatch) -> None:
        for s, d, n in zip(batch.src, batch.dst, batch.lengths):
            self._copy(d, s, n)
        self.bytes_written += batch.nbytes

    def close(self) -> None:
        pass


_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)


def cudart_candidates(maps_text: str, cuda_version: str | None) -> list[str]:
    """Where to find the CUDA runtime torch uses, best first: the libcudart already
    mapped into this process (``maps_text``: /proc/self/maps), then the soname of
    torch's CUDA major version (a cu130 torch ships libcudart.so.13, a cu12x one .12)."""
    out: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode path (which may hold spaces)
        path = fields[5].strip() if len(fields) == 6 else ""
        if os.path.basename(path).startswith("libcudart.so") and path not in out:
            out.append(path)
    if cuda_version:
        out.append(f"libcudart.so.{cuda_version.split('.')[0]}")
    return out


def load_cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch loaded (the same one, so its context is shared)."""
    import torch

    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = ""
    tried = cudart_candidates(maps, torch.version.cuda)
    if not tried:
        raise TransferError("cannot find the CUDA runtime torch uses: no libcudart is mapped into this "
                            "process and torch.version.cuda is unset")
    errors: list[str] = []
    for name in tried:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name} ({exc})")
    raise TransferError(f"cannot load the CUDA runtime torch uses (CUDA {torch.version.cuda}); tried "
                        + "; ".join(errors))


def _cuda_memcpy() -> Callable[[int, int, int], None] | None:
    """A memmove-shaped cudaMemcpy from the CUDA runtime torch loaded; None without CUDA."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    cudart = load_cudart()
    cudart.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def copy(dst: int, src: int, n: int) -> None:
        rc = cudart.cudaMemcpy(dst, src, n, _CUDA_MEMCPY_DEFAULT)
        if rc != 0:
            raise TransferError(f"cudaMemcpy of {n} bytes failed with CUDA error {rc}")
    return copy


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
