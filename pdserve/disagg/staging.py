"""Where the transfer engine reads and writes KV: the device buffers themselves, or host
copies of them.

Mooncake's CUDA build registers GPU memory and writes it directly ("direct"). Its
non-CUDA build (the `pd` extra) can only reach host memory, so on a GPU the KV is
staged ("host"): each rank keeps a pinned host twin of every transfer buffer with
the same slot layout, registers the twins, a prefill rank copies the slots a forward
filled into its twins before their write is queued, and a decode rank copies the
received slots into its device buffers before the request commits. On a CPU both
modes work (the "device" is host memory), which is how the staging path is tested.

The mode is chosen once at startup (``choose_staging``) and logged; a combination
that cannot work (direct GPU buffers with the non-CUDA build) is refused there.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Sequence

import torch

from pdserve.model.device_io import upload, upload_tensor

logger = logging.getLogger(__name__)

STAGING_MODES = ("auto", "direct", "host")


def mooncake_reaches_gpu_memory() -> bool:
    """Whether the installed Mooncake build can register GPU memory (the CUDA build is
    `mooncake-transfer-engine`; `mooncake-transfer-engine-non-cuda` cannot)."""
    try:
        importlib.metadata.version("mooncake-transfer-engine")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def choose_staging(mode: str, device: torch.device, gpu_capable: bool | None = None) -> str:
    """'direct' or 'host' for ``--disaggregation-kv-staging mode`` on ``device``; raises
    ValueError naming the flag when the combination cannot work."""
    if mode not in STAGING_MODES:
        raise ValueError(f"--disaggregation-kv-staging: must be one of {', '.join(STAGING_MODES)}, got {mode!r}")
    if device.type != "cuda":
        return "host" if mode == "host" else "direct"
    gpu_capable = mooncake_reaches_gpu_memory() if gpu_capable is None else gpu_capable
    if mode == "auto":
        return "direct" if gpu_capable else "host"
    if mode == "direct" and not gpu_capable:
        raise ValueError("--disaggregation-kv-staging direct: the installed Mooncake build "
                         "(mooncake-transfer-engine-non-cuda) cannot register GPU memory; install "
                         "mooncake-transfer-engine (its CUDA build) or use host (or auto)")
    return mode


class HostStaging:
    """Host twins (pinned on a GPU) of a rank's transfer buffers, slot for slot."""

    def __init__(self) -> None:
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (device buffer, host twin)

    def twin(self, name: str, buffer: torch.Tensor) -> torch.Tensor:
        """The host twin of ``buffer`` (made on first use): what the engine registers."""
        if name not in self.pairs:
            host = torch.zeros(buffer.shape, dtype=buffer.dtype, pin_memory=buffer.is_cuda)
            self.pairs[name] = (buffer, host)
        return self.pairs[name][1]

    def stage_out(self, slots: Sequence[int]) -> None:
        """Copy ``slots`` of every buffer to its twin (prefill, before their write is
        queued). The copy to host waits for the forward that filled them."""
        if not slots or not self.pairs:
            return
        host_idx = torch.tensor(list(slots), dtype=torch.int64)
        for buffer, host in self.pairs.values():
            dev_idx = host_idx.to(buffer.device)
            host.index_copy_(0, host_idx, buffer.index_select(0, dev_idx).to("cpu"))

    def stage_in(self, slots: Sequence[int]) -> None:
        """Copy ``slots`` of every twin into its device buffer (decode, once the transfer
        into the twins succeeded and before the request's first step reads them)."""
        if not slots or not self.pairs:
            return
        host_idx = torch.tensor(list(slots), dtype=torch.int64)
        for buffer, host in self.pairs.values():
            rows = upload_tensor(host.index_select(0, host_idx), buffer.device)
            buffer.index_copy_(0, upload(list(slots), torch.int64, buffer.device), rows)
