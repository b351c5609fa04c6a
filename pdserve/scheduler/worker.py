"""A scheduler rank: builds the runner and scheduler, then runs the TP lockstep loop.

Every rank runs an identical scheduler. Rank 0 receives commands (new
requests, aborts) and broadcasts them; all ranks then take the same step, so
their scheduling decisions and KV layouts agree without further messages
(sampled tokens are broadcast from rank 0 inside the step).
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from pdserve.config import ServerArgs
from pdserve.model.parallel import TPGroup, init_tp_group
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import Scheduler
from pdserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Command:
    add: tuple[Req, ...] = ()
    abort: tuple[str, ...] = ()
    flush_cache: bool = False
    memory_state: bool = False
    shutdown: bool = False


def build_scheduler(args: ServerArgs, model_dir: Path, tokenizer_dir: Path, tp: TPGroup) -> Scheduler:
    tokenizer = load_tokenizer(tokenizer_dir)

    def decode_text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    runner = ModelRunner(args, model_dir, tp)
    return Scheduler(args, runner, decode_text, tp)


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(args: ServerArgs, model_dir: Path, tokenizer_dir: Path, rank: int, init_method: str,
             conn: Connection | None) -> None:
    """Entry point of a TP scheduler process. Rank 0 talks to the engine over `conn`:
    it receives Command objects and sends ("ready", info), ("finished", [Req]),
    ("memory", dict), ("flushed", bool) or ("error", text)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp_size))
    try:
        tp = init_tp_group(rank, args.tp_size, init_method, args.resolved_device())
        sched = build_scheduler(args, model_dir, tokenizer_dir, tp)
    except Exception:
        if conn is not None:
            conn.send(("error", traceback.format_exc()))
        raise
    if conn is not None:
        conn.send(("ready", {"context_len": sched.context_len}))
    while True:
        if rank == 0:
            assert conn is not None
            cmds = []
            # Block only when idle; otherwise drain what arrived and keep stepping.
            if not sched.has_work or conn.poll():
                cmds.append(conn.recv())
                while conn.poll():
                    cmds.append(conn.recv())
            cmd = Command(
                add=tuple(r for c in cmds for r in c.add),
                abort=tuple(a for c in cmds for a in c.abort),
                flush_cache=any(c.flush_cache for c in cmds),
                memory_state=any(c.memory_state for c in cmds),
                shutdown=any(c.shutdown for c in cmds),
            )
            tp.broadcast_object(cmd)
        else:
            cmd = tp.broadcast_object(None)  # type: ignore[assignment]
        if cmd.shutdown:
            break
        finished: list[Req] = []
        for req in cmd.add:
            sched.add(req)
        for rid in cmd.abort:
            finished += sched.abort(rid)
        if cmd.flush_cache:
            flushed = sched.flush_cache()
            if conn is not None:
                conn.send(("flushed", flushed))
        if cmd.memory_state and conn is not None:
            conn.send(("memory", sched.memory_state()))
        finished += sched.step().finished
        if conn is not None and finished:
            conn.send(("finished", [_detached(r) for r in finished]))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _detached(req: Req) -> Req:
    """A finished request without scheduler-owned handles, safe to pickle."""
    req.lock_node = None
    req.pending_forks = []
    return req
