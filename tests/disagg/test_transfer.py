"""Mooncake TransferEngine over TCP on loopback between two processes: a planned KV write
lands exactly where the plan says, and a dead peer is an error, not a hang."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from pdserve.disagg.layout import BufferSpec, KVLayout, plan_transfer
from pdserve.disagg.transfer import MooncakeTransfer, TransferError, WriteBatch

SLOTS, WIDTH = 64, 32


def _receiver(info: mp.Queue, done: mp.Queue, result: mp.Queue) -> None:
    engine = MooncakeTransfer("127.0.0.1")
    bufs = {name: torch.zeros(SLOTS, WIDTH) for name in ("target.L0.K", "target.L0.V", "draft.L0.K")}
    specs = []
    for name, t in bufs.items():
        engine.register(t.data_ptr(), t.numel() * t.element_size())
        specs.append(BufferSpec(name, t.data_ptr(), SLOTS, WIDTH * 4))
    info.put((engine.session_id, KVLayout(1, tuple(specs))))
    done.get(timeout=60)
    result.put({name: t.numpy().copy() for name, t in bufs.items()})  # plain arrays: no shared storage


def test_mooncake_write_between_processes():
    ctx = mp.get_context("spawn")
    info, done, result = ctx.Queue(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(info, done, result), daemon=True)
    proc.start()
    try:
        session, dst_layout = info.get(timeout=60)
        engine = MooncakeTransfer("127.0.0.1")
        src = {name: torch.randn(SLOTS, WIDTH) for name in ("target.L0.K", "target.L0.V")}
        for t in src.values():
            engine.register(t.data_ptr(), t.numel() * t.element_size())
        src_layout = KVLayout(1, tuple(BufferSpec(n, t.data_ptr(), SLOTS, WIDTH * 4) for n, t in src.items()))
        plan = plan_transfer(src_layout, dst_layout, wanted=["target.L0.K", "target.L0.V"])
        src_slots, dst_slots = list(range(10, 30)), list(range(40, 60))
        # Each buffer's run (2560 bytes) goes in pieces, as a real prompt's runs go in 512 KiB ones.
        engine.max_entry_bytes = 1000
        engine.write(session, plan.writes(src_slots, dst_slots))
        done.put(1)
        got = {k: torch.from_numpy(v) for k, v in result.get(timeout=60).items()}
        for name in src:
            assert torch.equal(got[name][dst_slots], src[name][src_slots]), name
            assert not got[name][:40].any()
        assert not got["draft.L0.K"].any()
        # A peer that is not there fails the write with a message naming it.
        with pytest.raises(TransferError, match="127.0.0.1:1"):
            engine.write("127.0.0.1:1", WriteBatch((src["target.L0.K"].data_ptr(),), (0,), (4,)))
        engine.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


# ---- Mooncake's own log follows --log-level ---------------------------------------------------
_ENGINE_SCRIPT = """
import os, sys
from pdserve.disagg.transfer import MooncakeTransfer
engine = MooncakeTransfer("127.0.0.1", log_level=sys.argv[1])
print("MC_LOG_LEVEL left:", os.environ.get("MC_LOG_LEVEL"), flush=True)
engine.close()
"""


def _engine_output(log_level: str, **env: str) -> tuple[str, str]:
    """(stdout, stderr) of a fresh process that starts and closes a Mooncake engine."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}
    r = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, log_level], capture_output=True, text=True,
                       timeout=60, env={**base, **env})
    assert r.returncode == 0, r.stderr
    return r.stdout, r.stderr


def test_mooncake_log_is_quiet_below_debug_and_leaves_the_environment_alone():
    """A normal start at `info` prints none of Mooncake's dozen lines (one of them an `E`);
    the MC_LOG_LEVEL it sets for the library's load is not left for child processes,
    which would take it for the user's."""
    out, err = _engine_output("info")
    assert err == "", err
    assert "MC_LOG_LEVEL left: None" in out
    _, err = _engine_output("warning")
    assert err == "", err


def test_mooncake_log_shows_at_debug_and_a_user_level_wins():
    _, err = _engine_output("debug")
    assert "transfer_engine" in err and "Local segment descriptor not found" in err, err
    assert len([line for line in err.splitlines() if line[:1] in "IWE" and line[1:5].isdigit()]) >= 5, err
    out, err = _engine_output("info", MC_LOG_LEVEL="INFO")  # the user's own setting
    assert "transfer_engine" in err, err
    assert "MC_LOG_LEVEL left: INFO" in out
