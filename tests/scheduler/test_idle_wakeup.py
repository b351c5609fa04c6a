"""Rank 0 never waits for a command longer than IDLE_WAKEUP_S: the other TP ranks (on any
node) wait inside its broadcast meanwhile, and a gloo collective fails once the group's
deadline passes (torch's default 30 minutes), so an idle server would lose its followers.
Both of rank 0's links (the Engine's pipe, the server's ZMQ socket) return empty instead."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import zmq

from pdserve.scheduler import worker
from pdserve.scheduler.messages import Command
from pdserve.server import ipc, scheduler_process

pytestmark = pytest.mark.fast


def test_idle_wakeup_is_well_under_the_collective_deadline():
    assert 0 < worker.IDLE_WAKEUP_S <= 300


def test_pipe_io_returns_empty_after_the_wakeup(monkeypatch):
    monkeypatch.setattr(worker, "IDLE_WAKEUP_S", 0.05)
    ours, theirs = mp.Pipe()
    io = worker.PipeIO(theirs)
    start = time.monotonic()
    assert io.receive(block=True) == []
    assert time.monotonic() - start < 5
    ours.send(Command(get_state=True))
    assert io.receive(block=True) == [Command(get_state=True)]


def test_zmq_io_returns_empty_after_the_wakeup(monkeypatch):
    monkeypatch.setattr(scheduler_process, "IDLE_WAKEUP_S", 0.05)
    paths = ipc.IpcPaths.create()
    ctx = zmq.Context()
    try:
        io = scheduler_process.ZmqIO(paths)
        start = time.monotonic()
        assert io.receive(block=True) == []
        assert time.monotonic() - start < 5
        push = ipc.socket(ctx, zmq.PUSH, paths.scheduler, bind=False)
        push.send(ipc.dumps(Command(flush_cache=True)))
        assert io.receive(block=True) == [Command(flush_cache=True)]
        push.close()
        io.ctx.destroy(linger=0)
    finally:
        ctx.destroy(linger=0)
        paths.cleanup()
