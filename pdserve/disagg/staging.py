"""Where the transfer engine reads and writes KV: the device buffers themselves, or host
copies of them.

A transfer engine says whether it reaches device memory (``reaches_device_memory``,
as its class's ``capabilities()`` declare: engines.py): Mooncake's CUDA build registers
GPU memory and writes it directly ("direct"), and so does the in-process
``LocalTransfer`` (cudaMemcpy). Mooncake's non-CUDA build (the `pd` extra) can only
reach host memory, so on a GPU the KV is staged ("host"): each
rank keeps a host twin of every transfer buffer with the same slot layout, registers
the twins, a prefill rank copies the slots a forward filled into its twins before
their write is queued, and a decode rank copies the received slots into its device
buffers before the request commits. On a CPU both modes work (the "device" is host
memory), which is how the staging path is tested.

A twin is ordinary pageable memory of exactly its buffer's size, never zeroed (only
transferred slots are ever staged in or read), page-locked on a GPU with
cudaHostRegister: torch's pinned allocator would round each twin up to a power of two,
up to twice the KV pool in locked host memory. Locked or not, the twins are a copy of
the KV pool in host memory, so a rank's twins are refused at startup when they would
take more than ``HOST_STAGING_SHARE`` of the host's available memory.

The mode is chosen once at startup (``choose_staging``) and logged; a combination
that cannot work (direct GPU buffers with an engine that cannot reach them) is refused
there, and earlier, when the server's options are validated, from the engine's declared
capabilities alone (``staging_for_engine``: no engine is built).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import weakref
from typing import Any, Callable, Mapping, Sequence

import torch

from pdserve.disagg.engines import DEFAULT_TRANSFER_ENGINE, engine_capabilities
from pdserve.disagg.transfer import TransferError, load_cudart
from pdserve.model.device_io import upload, upload_tensor

logger = logging.getLogger(__name__)

STAGING_MODES = ("auto", "direct", "host")

# The share of the host's available memory (MemAvailable) a rank's twins may take: the
# rest is for the process itself, the tokenizer and detokenizer, and the other servers
# of a host.
HOST_STAGING_SHARE = 0.8


class StagingMemoryError(ValueError):
    """The host cannot hold the host twins of a rank's transfer buffers."""


def choose_staging(mode: str, device: torch.device, reaches_device_memory: bool,
                   engine: str = DEFAULT_TRANSFER_ENGINE) -> str:
    """'direct' or 'host' for ``--disaggregation-kv-staging mode`` on ``device`` with a
    transfer engine that can (or cannot) reach device memory; raises ValueError naming
    the flag when the combination cannot work (with what the registered engine `engine`
    declares about why, and what to do)."""
    if mode not in STAGING_MODES:
        raise ValueError(f"--disaggregation-kv-staging: must be one of {', '.join(STAGING_MODES)}, got {mode!r}")
    if device.type != "cuda":
        return "host" if mode == "host" else "direct"
    if mode == "auto":
        return "direct" if reaches_device_memory else "host"
    if mode == "direct" and not reaches_device_memory:
        caps = engine_capabilities(engine)
        why = f" ({caps.device_memory_why_not})" if caps.device_memory_why_not else ""
        remedy = f"{caps.device_memory_remedy} or " if caps.device_memory_remedy else ""
        raise ValueError(f"--disaggregation-kv-staging direct: the transfer engine cannot reach GPU memory{why}; "
                         f"{remedy}use host (or auto)")
    return mode


def staging_for_engine(mode: str, device: torch.device, engine: str) -> str:
    """``choose_staging`` for the registered transfer engine `engine`, from what its class
    declares it reaches in this installation (nothing is built): the startup check."""
    return choose_staging(mode, device, engine_capabilities(engine).reaches_device_memory, engine)


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The host's MemAvailable in bytes; None where it cannot be read (not Linux)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def page_lock(host: torch.Tensor, cudart: Any) -> Callable[[], None] | None:
    """Page-lock ``host``'s bytes (cudaHostRegister) so copies to and from the GPU are
    DMA; the undo, or None (with a warning: the twin stays pageable, which works, more
    slowly) when the driver refuses."""
    ptr, nbytes = host.data_ptr(), host.numel() * host.element_size()
    rc = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if rc != 0:
        cudart.cudaGetLastError()  # else torch would report it at its next kernel launch
        logger.warning("cudaHostRegister of a %.2f GiB KV staging buffer failed with CUDA error %d; it stays "
                       "pageable (slower host <-> device copies)", nbytes / 2**30, rc)
        return None

    def unlock() -> None:
        rc = int(cudart.cudaHostUnregister(ptr))
        if rc != 0:
            cudart.cudaGetLastError()
            logger.debug("cudaHostUnregister(%#x) failed with CUDA error %d", ptr, rc)
    return unlock


def _host_register_api() -> ctypes.CDLL:
    """The CUDA runtime torch uses, typed for page_lock. Not torch.cuda.cudart(): its
    bindings lack cudaGetLastError, needed to clear a refused registration's error."""
    lib = load_cudart()
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    return lib


class HostStaging:
    """Host twins (page-locked on a GPU) of a rank's transfer buffers, slot for slot.
    ``available`` reads the host's available memory (default: MemAvailable); ``lock``
    page-locks the twins (default: those of CUDA buffers) through ``cudart`` (default:
    the CUDA runtime torch uses). Tests inject all three."""

    def __init__(self, available: Callable[[], int | None] | None = None, lock: bool | None = None,
                 cudart: Any = None) -> None:
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (device buffer, host twin)
        self._available = available
        self._lock = lock
        self._cudart = cudart
        self._unlocks: list[weakref.finalize] = []

    def twins(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The host twins of ``buffers``, made now for those without one once the host is
        known to hold all of them together: a server that cannot is refused here, at
        startup, rather than swapping or being killed later."""
        new = {name: b for name, b in buffers.items() if name not in self.pairs}
        need = sum(b.numel() * b.element_size() for b in new.values())
        available = (self._available or host_available_bytes)() if need else None
        if available is not None and need > HOST_STAGING_SHARE * available:
            gib = 2 ** 30
            raise StagingMemoryError(
                f"--disaggregation-kv-staging host: the host copies of the KV buffers need {need / gib:.2f} GiB, "
                f"more than {HOST_STAGING_SHARE:.0%} of the host's {available / gib:.2f} GiB of available memory; "
                "give a smaller KV pool (--max-total-tokens, or a lower --mem-fraction-static) or stage "
                "directly (--disaggregation-kv-staging direct, with a transfer engine that reaches GPU memory)")
        for name, buffer in new.items():
            lock = buffer.is_cuda if self._lock is None else self._lock
            self.pairs[name] = (buffer, self._make_twin(buffer, lock))
        return {name: self.pairs[name][1] for name in buffers}

    def twin(self, name: str, buffer: torch.Tensor) -> torch.Tensor:
        """The host twin of ``buffer`` (made on first use): what the engine registers."""
        return self.twins({name: buffer})[name]

    def _make_twin(self, buffer: torch.Tensor, lock: bool) -> torch.Tensor:
        nbytes = buffer.numel() * buffer.element_size()
        if not lock:
            return torch.empty(buffer.shape, dtype=buffer.dtype)
        # Page-aligned and owning its pages whole: a page shared with another allocation
        # (another twin) would make the second registration fail.
        page = mmap.PAGESIZE
        raw = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
        start = -raw.data_ptr() % page
        host = raw[start:start + nbytes].view(buffer.dtype).view(buffer.shape)
        if self._cudart is None:
            try:
                self._cudart = _host_register_api()
            except TransferError as exc:
                logger.warning("KV staging buffers stay pageable (slower host <-> device copies): %s", exc)
                self._cudart = False
        unlock = page_lock(host, self._cudart) if self._cudart is not False else None
        if unlock is not None:
            # Unlocked by close(), or when the twin goes (a staging never closed).
            done = weakref.finalize(host, unlock)
            done.atexit = False  # at exit the process's locked pages go with it
            self._unlocks.append(done)
        return host

    def close(self) -> None:
        """Unlock the twins' pages (they are freed with this object)."""
        for done in self._unlocks:
            done()
        self._unlocks.clear()

    def stage_out(self, slots: Sequence[int]) -> None:
        """Copy ``slots`` of every buffer to its twin (prefill, before their write is
        queued). The copy to host waits for the forward that filled them."""
        if not slots or not self.pairs:
            return
        host_idx = torch.tensor(list(slots), dtype=torch.int64)
        for buffer, host in self.pairs.values():
            dev_idx = host_idx.to(buffer.device)
            _raw(host).index_copy_(0, host_idx, _raw(buffer.index_select(0, dev_idx).to("cpu")))

    def stage_in(self, slots: Sequence[int]) -> None:
        """Copy ``slots`` of every twin into its device buffer (decode, once the transfer
        into the twins succeeded and before the request's first step reads them)."""
        if not slots or not self.pairs:
            return
        host_idx = torch.tensor(list(slots), dtype=torch.int64)
        for buffer, host in self.pairs.values():
            rows = upload_tensor(host.index_select(0, host_idx), buffer.device)
            _raw(buffer).index_copy_(0, upload(list(slots), torch.int64, buffer.device), _raw(rows))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 KV as its bytes: the CPU's index_copy_ has no float8 kernel; a copy moves
    bytes either way (the same view of the same storage)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
