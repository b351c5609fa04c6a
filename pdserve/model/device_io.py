"""Host <-> device traffic of a step, in one place.

Step metadata (rows, lengths, token ids) is built on the host from Python values
the scheduler already holds, then goes up through pinned memory with
``non_blocking=True``: a pageable copy would make the host wait for the device.
The only device-to-host read a decode step makes is ``fetch`` of the sampled
ids (and their logprobs, packed into the same transfer).
"""

from __future__ import annotations

from typing import Sequence

import torch


def upload(values: Sequence[int] | Sequence[float] | Sequence[bool], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """A 1-D tensor of ``values`` on ``device`` without a host-device sync."""
    return upload_tensor(torch.tensor(values, dtype=dtype), device)


def upload_rows(rows: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 2-D tensor (rows of equal length) on ``device`` without a host-device sync."""
    return upload_tensor(torch.tensor(rows, dtype=dtype), device)


def upload_tensor(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host-device sync."""
    if device.type == "cpu":
        return host
    # The caching host allocator keeps a pinned block alive until the copy that
    # reads it has run, so reusing memory here cannot race with the transfer.
    return host.pin_memory().to(device, non_blocking=True)


def fetch(x: torch.Tensor) -> list:
    """The step's one device-to-host read: ``x`` as nested Python lists."""
    return x.tolist()
