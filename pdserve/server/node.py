"""Multi-node TP (``--nnodes N``): what runs on a node other than node 0, and how node 0
ends the group.

Node R > 0 runs only its scheduler processes, TP ranks [R * tp/N, (R + 1) * tp/N):
no HTTP server, tokenizer manager or detokenizer (node 0's rank 0 receives every
command and broadcasts it over the TP group, so the other ranks need nothing else).
This process starts them, waits until they report ready (which happens only once
the whole group, on every node, has built: pdserve/scheduler/worker.py), and then
waits for them to end: when node 0 shuts the group down, when the group breaks (a
rank on another node died), or on SIGTERM / Ctrl-C here. It never outlives them,
and they never outlive it (PDEATHSIG).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import signal
import sys
import time
from typing import Any

import zmq

from pdserve.config import ServerArgs
from pdserve.engine import check_tp_layout, resolve_model_dir
from pdserve.scheduler.messages import Command
from pdserve.server import ipc
from pdserve.server.scheduler_process import run_scheduler_process


class _Stop(Exception):
    """SIGTERM or SIGINT reached this node's launcher."""


def startup_timeout(args: ServerArgs) -> float:
    """How long a launcher waits for its ranks' ready reports: the rendezvous may take
    its whole --dist-timeout (another node starting late) before the model loads."""
    return max(600.0, args.rendezvous_timeout() + 300.0)


def run_node(args: ServerArgs) -> int:
    """The launcher of node ``args.node_rank`` > 0; returns the exit status."""
    from pdserve.server.launch import StartupError, _wait_ready, resolve_tokenizer_dir, stop_children
    from pdserve.scheduler.worker import tp_init_method

    model_dir = resolve_model_dir(args)
    tokenizer_dir = resolve_tokenizer_dir(args, model_dir)
    check_tp_layout(model_dir, args.tp_size)  # fail before the rendezvous, not inside it
    ranks = args.node_tp_ranks()
    where = f"node {args.node_rank} of {args.nnodes} (TP ranks {ranks.start}-{ranks.stop - 1} of {args.tp_size})"
    ctx = mp.get_context("spawn")
    init_method = tp_init_method(args)
    pending = []
    for rank in ranks:
        r, w = ctx.Pipe(duplex=False)
        pending.append((ctx.Process(target=run_scheduler_process,
                                    args=(args, model_dir, tokenizer_dir, rank, init_method, None, w),
                                    name=f"pdserve-scheduler-tp{rank}", daemon=True), r))
    procs = [p for p, _ in pending]

    def on_signal(signum: int, frame: Any) -> None:
        raise _Stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for p in procs:
            p.start()
        print(f"pdserve {where}: joining the TP group at {args.dist_init_addr}", flush=True)
        _wait_ready(pending, startup_timeout(args))
        print(f"pdserve {where} ready; this node serves no HTTP (node 0 does)", flush=True)
        multiprocessing.connection.wait([p.sentinel for p in procs])
        time.sleep(0.5)  # the group ends on every rank at once: let the others finish too
        failed = [p for p in procs if p.exitcode not in (0, None)]
        if not failed:
            print(f"pdserve {where}: node 0 shut the TP group down; exiting", flush=True)
            return 0
        print(f"pdserve {where}: {failed[0].name} exited with code {failed[0].exitcode}: the TP group "
              "ended (node 0 or another node stopped or failed); stopping this node", file=sys.stderr, flush=True)
        return 1
    except StartupError as exc:
        print(f"pdserve {where}: {exc}", file=sys.stderr, flush=True)
        return 1
    except _Stop as why:
        print(f"pdserve {where}: {why} received; stopping this node's ranks (the TP group ends with them)",
              file=sys.stderr, flush=True)
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        stop_children(procs)


def shut_down_group(paths: ipc.IpcPaths, ranks: list[Any], timeout: float = 10.0) -> None:
    """Node 0, stopping after it served: send rank 0 the shutdown command, which it
    broadcasts, so every rank on every node leaves its loop and exits 0 (the other
    nodes' launchers then exit too). Ranks still running afterwards are terminated by
    the caller."""
    ctx = zmq.Context()
    try:
        sock = ipc.socket(ctx, zmq.PUSH, paths.scheduler, bind=False)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.send(ipc.dumps(Command(shutdown=True)))
        sock.close()
    finally:
        ctx.destroy(linger=1000)
    deadline = time.monotonic() + timeout
    for p in ranks:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
