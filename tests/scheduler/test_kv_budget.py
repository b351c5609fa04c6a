"""The device KV budget counts what this process's caching allocator holds reserved but
unallocated as free: the driver (``mem_get_info``) reports it used, yet this process
can allocate it, e.g. the pools of an engine shut down before this one started."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.model.parallel import TPGroup
from pdserve.scheduler.memory_budget import MemoryBudgetError, device_free_bytes, device_kv_budget, size_kv_pages
from pdserve.scheduler.memory import TokenToKVPool

pytestmark = pytest.mark.fast

GIB = 1 << 30
TOTAL, WEIGHTS = 80 * GIB, 16 * GIB
# A first engine's 50 GiB pool was freed but stays reserved by the allocator; 1 GiB of
# CUDA context is outside it.
CACHED = 50 * GIB
FREE = TOTAL - WEIGHTS - CACHED - 1 * GIB


def test_reserved_unallocated_memory_counts_as_free():
    # Without it, the 0.9 share (56 GiB of KV) looks larger than the 13 GiB "free".
    with pytest.raises(MemoryBudgetError, match="only 13.00 GiB"):
        device_kv_budget(free=FREE, total=TOTAL, held=WEIGHTS, fraction=0.9)
    assert device_kv_budget(free=FREE, total=TOTAL, held=WEIGHTS, fraction=0.9, cached=CACHED) == \
        int(TOTAL * 0.9) - WEIGHTS
    # The share is still a share of the device: cached memory does not raise it.
    assert device_kv_budget(free=FREE, total=TOTAL, held=WEIGHTS, fraction=0.4, cached=CACHED) == \
        int(TOTAL * 0.4) - WEIGHTS
    # More than free + cached is still refused, naming both together as free.
    with pytest.raises(MemoryBudgetError, match="only 63.00 GiB"):
        device_kv_budget(free=FREE, total=TOTAL, held=WEIGHTS, fraction=0.99, cached=CACHED)


def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA memory queries of a device in the state above (no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (FREE, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: WEIGHTS)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: WEIGHTS + CACHED)


def test_the_kv_pool_is_sized_with_the_allocators_cached_memory(monkeypatch):
    fake_cuda(monkeypatch)
    cfg = SimpleNamespace(num_layers=32, head_dim=128)
    runner = SimpleNamespace(config=cfg, num_local_kv_heads=8, kv_dtype=torch.bfloat16,
                             device=torch.device("cuda", 0), context_len=1 << 20)
    args = ServerArgs(device="cpu", mem_fraction_static=0.9, page_size=16, max_running_requests=1 << 20)
    pages = size_kv_pages(args, runner, TPGroup())  # type: ignore[arg-type]
    per_token = TokenToKVPool.bytes_per_token(32, 8, 128, torch.bfloat16)
    assert pages - 1 == (int(TOTAL * 0.9) - WEIGHTS) // per_token // 16
    assert device_free_bytes(torch.device("cuda", 0)) == FREE + CACHED
    assert device_free_bytes(torch.device("cpu")) is None
