"""Issue 33's predicted GPU failures of the transfer path, checked on CPU: the staging mode
follows what the transfer engine in use reaches (LocalTransfer copies GPU memory
itself), LocalTransfer finds the CUDA runtime torch loaded and closes, and host staging
makes exact-size page-locked twins, refused at startup when the host cannot hold them."""

from __future__ import annotations

import logging
import mmap
import os
from types import SimpleNamespace

import pytest
import torch

import pdserve.disagg.staging as staging_mod
from pdserve.config import ConfigError, ServerArgs
from pdserve.disagg.staging import HostStaging, StagingMemoryError, choose_staging
from pdserve.disagg.transfer import (LocalTransfer, MooncakeTransfer, TransferError, cudart_candidates, load_cudart,
                                     mooncake_reaches_gpu_memory)
from pdserve.disagg.handoff import transfer_staging
from pdserve.disagg.prefill_side import prefill_scheduler
from tests.disagg.test_pd_schedulers import dirs, sched  # noqa: F401

pytestmark = pytest.mark.fast

GPU = torch.device("cuda")  # a value only: nothing is allocated on it


# ---- A: the mode follows the engine ------------------------------------------------------------
class _Engine:
    def __init__(self, reaches: bool) -> None:
        self.reaches_device_memory = reaches


def test_staging_on_a_gpu_follows_what_the_engine_reaches():
    for mode in ("direct", "auto"):
        assert choose_staging(mode, GPU, _Engine(True).reaches_device_memory) == "direct"
    assert choose_staging("host", GPU, True) == "host"
    with pytest.raises(ValueError, match="--disaggregation-kv-staging direct"):
        choose_staging("direct", GPU, _Engine(False).reaches_device_memory)
    assert choose_staging("auto", GPU, False) == "host"


def test_a_local_transfer_side_stages_directly_on_a_gpu_whatever_mooncake_is_installed():
    # LocalTransfer copies with cudaMemcpy where CUDA is in use (memmove on a CPU-only
    # torch): it reaches device memory, so the non-CUDA Mooncake build installed here
    # must not force host staging on it (nor refuse direct).
    engine = LocalTransfer()
    assert engine.reaches_device_memory
    for mode in ("direct", "auto"):
        side = SimpleNamespace(args=SimpleNamespace(disaggregation_kv_staging=mode), device=GPU)
        assert transfer_staging(side, engine) is None  # type: ignore[arg-type]
    side = SimpleNamespace(args=SimpleNamespace(disaggregation_kv_staging="direct"), device=GPU)
    with pytest.raises(ValueError, match="--disaggregation-kv-staging direct"):
        transfer_staging(side, _Engine(False))  # type: ignore[arg-type]


def test_mooncake_reaches_gpu_memory_only_with_its_cuda_build():
    engine = MooncakeTransfer("127.0.0.1")  # as tests/disagg/test_transfer.py: CI has libibverbs1
    try:
        assert engine.reaches_device_memory == mooncake_reaches_gpu_memory()
    finally:
        engine.close()


def test_the_startup_check_validates_the_flag_for_the_mooncake_build(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    flags = dict(disaggregation_mode="prefill", disaggregation_kv_staging="direct")
    monkeypatch.setattr("pdserve.disagg.transfer.mooncake_reaches_gpu_memory", lambda: False)
    with pytest.raises(ConfigError, match="--disaggregation-kv-staging"):
        ServerArgs(**flags)
    assert ServerArgs(disaggregation_mode="prefill", disaggregation_kv_staging="auto").disaggregation_kv_staging
    monkeypatch.setattr("pdserve.disagg.transfer.mooncake_reaches_gpu_memory", lambda: True)
    assert ServerArgs(**flags).disaggregation_kv_staging == "direct"


# ---- B: LocalTransfer's CUDA runtime and close() -----------------------------------------------
CU13 = "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"
CU12 = "/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"
MAPS = """\
7f0000000000-7f0000001000 r--p 00000000 103:02 1234    /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000001000-7f0000002000 r-xp 00001000 103:02 4321    {lib}
7f0000002000-7f0000003000 r--p 00002000 103:02 4321    {lib}
7f0000003000-7f0000004000 rw-p 00000000 00:00 0
7f0000004000-7f0000005000 r--p 00000000 103:02 99      /opt/lib dir/libcudart_static_not.so
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0        [stack]
"""


def test_the_cuda_runtime_is_the_one_torch_loaded_else_torchs_major_version():
    assert cudart_candidates(MAPS.format(lib=CU13), "13.0") == [CU13, "libcudart.so.13"]
    assert cudart_candidates(MAPS.format(lib=CU12), "12.4") == [CU12, "libcudart.so.12"]
    unmapped = MAPS.format(lib="/usr/lib/libfoo.so")
    assert cudart_candidates(unmapped, "13.0") == ["libcudart.so.13"]
    assert cudart_candidates(unmapped, "12.4") == ["libcudart.so.12"]
    assert cudart_candidates(unmapped, None) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process with no CUDA runtime mapped")
def test_a_cuda_runtime_that_cannot_load_is_an_error_naming_what_was_tried(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "99.0")
    with pytest.raises(TransferError, match=r"libcudart\.so\.99"):
        load_cudart()


def test_local_transfer_closes():
    LocalTransfer().close()


# ---- C: host twins -----------------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the process's resident memory")
def test_a_twin_is_its_buffers_exact_size_and_left_untouched():
    buf = torch.empty(3000, 1000, dtype=torch.float32)  # ~11.4 MiB, not a power of two; untouched too
    nbytes = buf.numel() * buf.element_size()
    before = _rss()
    twin = HostStaging().twin("kv", buf)
    grown = _rss() - before
    assert twin.shape == buf.shape and twin.dtype == buf.dtype
    assert twin.untyped_storage().nbytes() == nbytes
    assert grown < nbytes // 4, f"making the twin touched {grown} bytes of its {nbytes}"


class _FakeCudart:
    def __init__(self, register_rc: int = 0) -> None:
        self.register_rc = register_rc
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.cleared = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered.append((ptr, size, flags))
        return self.register_rc

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0

    def cudaGetLastError(self) -> int:
        self.cleared += 1
        return 0


def test_a_gpu_twin_is_pageable_memory_of_exactly_its_size_page_locked_until_close():
    cudart = _FakeCudart()
    staging = HostStaging(lock=True, cudart=cudart)  # what a CUDA buffer gets
    bufs = {"a": torch.randn(37, 5, dtype=torch.bfloat16), "b": torch.randn(1000, 3)}
    twins = staging.twins(bufs)
    assert sorted(cudart.registered) == sorted((t.data_ptr(), b.numel() * b.element_size(), 0)
                                              for t, b in zip(twins.values(), bufs.values()))
    for name, t in twins.items():
        assert t.shape == bufs[name].shape and t.dtype == bufs[name].dtype and not t.is_pinned()
        assert t.data_ptr() % mmap.PAGESIZE == 0  # owns its pages: no two twins share one
    staging.stage_out([0, 5, 36])
    for name, t in twins.items():
        assert torch.equal(t[[0, 5, 36]], bufs[name][[0, 5, 36]])
    staging.close()
    staging.close()
    assert sorted(cudart.unregistered) == sorted(t.data_ptr() for t in twins.values())


def test_a_refused_page_lock_leaves_the_twin_pageable_with_a_warning(caplog):
    cudart = _FakeCudart(register_rc=2)  # cudaErrorMemoryAllocation
    staging = HostStaging(lock=True, cudart=cudart)
    with caplog.at_level(logging.WARNING, logger="pdserve.disagg.staging"):
        twin = staging.twin("kv", torch.ones(16, 4))
    assert "cudaHostRegister" in caplog.text and cudart.cleared == 1
    staging.stage_out([3])
    assert (twin[3] == 1).all()
    staging.close()
    assert cudart.unregistered == []


def test_twins_the_host_cannot_hold_are_refused_naming_the_flags():
    bufs = {"a": torch.zeros(100, 8), "b": torch.zeros(100, 8)}  # 6400 bytes together
    with pytest.raises(StagingMemoryError, match="--max-total-tokens.*--mem-fraction-static.*"
                                                 "--disaggregation-kv-staging"):
        HostStaging(available=lambda: 7000).twins(bufs)  # 80% of it: 5600 bytes
    assert set(HostStaging(available=lambda: 8000).twins(bufs)) == {"a", "b"}
    assert HostStaging(available=lambda: None).twin("a", bufs["a"]).shape == (100, 8)  # unknown: not refused


def test_a_host_staged_server_the_host_cannot_hold_is_refused_at_startup(dirs, monkeypatch):  # noqa: F811
    monkeypatch.setattr(staging_mod, "host_available_bytes", lambda: 1 << 20)
    with pytest.raises(StagingMemoryError, match="--max-total-tokens"):
        sched(prefill_scheduler, dirs, None, {"disaggregation_kv_staging": "host"})
