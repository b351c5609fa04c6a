"""Start a server instance: detokenizer and scheduler processes, then HTTP in this process.

With --nnodes > 1 this is node 0, which starts only its own TP ranks; a node of rank
R > 0 runs server/node.py instead (its ranks, no HTTP). Startup waits for every child to report ready and fails with the child's
message if one dies. On shutdown (Ctrl-C, SIGTERM) every child is stopped;
children also die with this process if it is killed outright (PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from contextlib import asynccontextmanager
from typing import Any

import uvicorn

from pdserve.chat_templates import apply_chat_template_override
from pdserve.config import ServerArgs
from pdserve.engine import check_tp_layout, resolve_model_dir
from pdserve.logs import quiet_uvicorn
from pdserve.requests import RequestBuilder
from pdserve.scheduler.grammar import GrammarLimits
from pdserve.scheduler.worker import tp_init_method
from pdserve.server import ipc
from pdserve.server.detokenizer import run_detokenizer_process
from pdserve.server.drain import Drain, QueueLimit
from pdserve.server.grammar_check import GrammarChecker
from pdserve.server.app import create_app
from pdserve.server.http_connection import MAX_HEADER_BYTES, protocol_class
from pdserve.server.metrics import ServerMetrics
from pdserve.server.node import run_node, shut_down_group, startup_timeout
from pdserve.server.scheduler_process import run_scheduler_process
from pdserve.server.tokenizer_manager import TokenizerManager
from pdserve.tokenizer import load_tokenizer

logger = logging.getLogger("pdserve")


class StartupError(RuntimeError):
    pass


def server_args_dict(args: ServerArgs) -> dict[str, Any]:
    """The arguments as /get_server_info shows them, every secret masked."""
    d = dataclasses.asdict(args)
    for name in ("api_key", "admin_api_key", "disaggregation_secret"):
        if d.get(name):
            d[name] = "***"
    return d


def _wait_ready(children: list[tuple[Any, Any]], timeout: float = 600.0) -> list[dict[str, Any]]:
    infos: list[dict[str, Any] | None] = [None] * len(children)
    deadline = time.monotonic() + timeout
    while any(i is None for i in infos):
        if time.monotonic() > deadline:
            raise StartupError("timed out waiting for the server processes to start")
        for k, (proc, conn) in enumerate(children):
            if infos[k] is not None:
                continue
            if conn.poll(0.05):
                kind, payload = conn.recv()
                if kind != "ready":
                    raise StartupError(f"{proc.name} failed to start:\n{payload}")
                infos[k] = payload
            elif not proc.is_alive():
                raise StartupError(f"{proc.name} exited during startup (exit code {proc.exitcode})")
    return infos  # type: ignore[return-value]


def stop_children(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


class _Server(uvicorn.Server):
    """uvicorn's server, but SIGTERM drains (pdserve/server/drain.py) instead of stopping.

    uvicorn's own SIGTERM handling closes the listening socket at once (so /health could
    not answer "draining" and Kubernetes' probes would see refused connections) and cuts
    in-flight requests after `timeout_graceful_shutdown`. Here SIGTERM starts the drain,
    which stops uvicorn (`should_exit`) once nothing is in flight. SIGINT (Ctrl-C) keeps
    uvicorn's quick stop."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self.loop: asyncio.AbstractEventLoop | None = None
        drain.stop = self.request_exit
        drain.open_peers = lambda: {c.client for c in self.server_state.connections if c.client}

    def request_exit(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and self.loop is not None and not self.should_exit:
            # A signal handler runs between two bytecodes of the loop's thread: hand the
            # drain to the loop. Not recorded in uvicorn's _captured_signals either, which
            # it re-raises after serving: the process would die of SIGTERM, not exit 0.
            # A second SIGTERM while draining changes nothing (a preStop POST /drain is
            # usually followed by Kubernetes' SIGTERM).
            self.loop.call_soon_threadsafe(self.drain.start, "SIGTERM")
            return
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            host, port = self.config.host, self.config.port
            print(f"pdserve ready on http://{host}:{port}", flush=True)


def launch(args: ServerArgs) -> int:
    if args.node_rank > 0:  # multi-node TP: this node runs its ranks only (pdserve/server/node.py)
        return run_node(args)
    model_dir = resolve_model_dir(args)
    if args.tp_size > 1:
        check_tp_layout(model_dir, args.tp_size)  # before any process starts (or another node waits)
    tokenizer_dir = resolve_tokenizer_dir(args, model_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    apply_chat_template_override(tokenizer, args.chat_template)  # before any process starts: fail fast
    paths = ipc.IpcPaths.create()
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    served = False
    try:
        pending = []
        r, w = ctx.Pipe(duplex=False)
        detok = ctx.Process(target=run_detokenizer_process, args=(tokenizer_dir, paths, w),
                            name="pdserve-detokenizer", daemon=True)
        pending.append((detok, r))
        init_method = tp_init_method(args)
        for rank in args.node_tp_ranks():  # all of them, unless the group spans --nnodes
            r, w = ctx.Pipe(duplex=False)
            sched = ctx.Process(target=run_scheduler_process,
                                args=(args, model_dir, tokenizer_dir, rank, init_method, paths, w),
                                name=f"pdserve-scheduler-tp{rank}", daemon=True)
            pending.append((sched, r))
        for proc, _ in pending:
            proc.start()
            procs.append(proc)
        if args.nnodes > 1:
            print(f"pdserve node 0 of {args.nnodes}: TP ranks 0-{len(args.node_tp_ranks()) - 1} of "
                  f"{args.tp_size} here; waiting for the other nodes at {args.dist_init_addr}", flush=True)
        infos = _wait_ready(pending, startup_timeout(args))
        rank0 = infos[1]
        builder = RequestBuilder(tokenizer, rank0["context_len"], rank0["vocab_size"], args.max_n,
                                 args.random_seed)
        metrics = ServerMetrics()
        manager = TokenizerManager(builder, paths, metrics, procs,
                                   grammar=GrammarChecker(GrammarLimits.from_args(args)))
        drain = Drain(manager, args.graceful_shutdown_timeout)
        manager.drain = drain
        manager.queue_limit = QueueLimit(args.max_queued_requests, args.max_running_requests)

        def server_info() -> dict[str, Any]:
            return {"server_args": server_args_dict(args), "version": _version(),
                    "pids": [os.getpid()] + [p.pid for p in procs], "scheduler_pid": procs[1].pid,
                    "model_path": str(model_dir)}

        @asynccontextmanager
        async def lifespan(_: Any) -> Any:
            manager.start()
            yield
            await manager.close()

        app = create_app(args, manager, args.served_names(), server_info)
        app.router.lifespan_context = lifespan
        # Slow, idle or oversized clients are cut off before they reach the app (http_connection).
        # timeout_graceful_shutdown: after a drain only finished responses are still being
        # written; on Ctrl-C it is what in-flight requests get.
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=5,
                                http=protocol_class(args.request_read_timeout, args.send_timeout),
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                                timeout_keep_alive=min(5.0, args.request_read_timeout))
        quiet_uvicorn(args.log_level)  # after Config, which sets uvicorn's loggers up
        server = _Server(config, drain)
        logging.getLogger("uvicorn.access").addFilter(_quiet_probes)
        served = True
        server.run()
        return 0
    except StartupError as exc:
        print(f"pdserve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if served and args.nnodes > 1:  # the other nodes' ranks leave with the shutdown command
            shut_down_group(paths, procs[1:])
        stop_children(procs)
        paths.cleanup()


def _quiet_probes(record: logging.LogRecord) -> bool:
    """Routers probe /health and /get_load every second: keep them out of the access log."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (len(args) >= 3 and args[2] in ("/health", "/get_load"))


def resolve_tokenizer_dir(args: ServerArgs, model_dir: Any) -> Any:
    from pathlib import Path

    return Path(args.tokenizer_path) if args.tokenizer_path else Path(model_dir)


def _version() -> str:
    from pdserve import __version__

    return __version__
