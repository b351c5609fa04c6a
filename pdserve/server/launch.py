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
from pdserve import logs
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
from pdserve.server.startup_summary import resolved_server_args, summary_line
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
    """uvicorn's server, but SIGTERM and Ctrl-C drain (pdserve/server/drain.py) instead of
    stopping.

    uvicorn's own handling closes the listening socket at once (so /health could not
    answer "draining" and Kubernetes' probes would see refused connections), cuts
    in-flight requests after `timeout_graceful_shutdown` (a client mid-stream got a broken
    response and the log a traceback) and re-raises the signal after serving (the process
    died of it). Here SIGTERM and SIGINT start the drain, which stops uvicorn
    (`should_exit`) once nothing is in flight, and the process exits 0. A second Ctrl-C
    while draining ends what is still in flight at once, each request with an error (an
    error event and [DONE] on a stream). A process started with SIGINT ignored (the
    servers of `pdserve up`, a background job) keeps ignoring it: a terminal's Ctrl-C
    reaches the whole process group, and the parent drives the shutdown (router first)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, ready_line: str, label: str,
                 sigint_ignored: bool) -> None:
        super().__init__(config)
        self.drain = drain
        self.ready_line = ready_line
        self.label = label
        self.sigint_ignored = sigint_ignored
        self.loop: asyncio.AbstractEventLoop | None = None
        drain.stop = self.request_exit
        drain.open_peers = lambda: {c.client for c in self.server_state.connections if c.client}

    def request_exit(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Never recorded in uvicorn's _captured_signals, which it re-raises after serving.
        if sig == signal.SIGINT and self.sigint_ignored:
            return
        if self.loop is None or self.should_exit:  # not serving yet, or stopping already
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # uvicorn's second Ctrl-C: stop waiting for connections
            self.should_exit = True
            return
        # A signal handler runs between two bytecodes of the loop's thread: hand the drain
        # to the loop. A second SIGTERM while draining changes nothing (a preStop POST
        # /drain is usually followed by Kubernetes' SIGTERM); a second Ctrl-C cuts it short.
        if sig == signal.SIGINT and self.drain.draining:
            self.loop.call_soon_threadsafe(self.drain.cut_short, "a second Ctrl-C")
            return
        self.loop.call_soon_threadsafe(self.drain.start, signal.Signals(sig).name)

    async def startup(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            logs.announce(self.label, self.ready_line)


def launch(args: ServerArgs) -> int:
    label = logs.server_label(args.disaggregation_mode)
    logs.configure(args.log_level, label)
    try:
        return _launch(args, label)
    except KeyboardInterrupt:  # Ctrl-C before the server listened (afterwards it drains)
        logger.info("interrupted while starting: stopped")
        return 0


def _launch(args: ServerArgs, label: str) -> int:
    # Started with SIGINT ignored (pdserve up's servers, a background job): the parent
    # drives the shutdown, and this process keeps ignoring a terminal's Ctrl-C.
    sigint_ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
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
        detok = ctx.Process(target=run_detokenizer_process, args=(tokenizer_dir, paths, w, args.log_level, label),
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
        settings = rank0["settings"]
        logger.info("%s", summary_line(args, settings))
        builder = RequestBuilder(tokenizer, rank0["context_len"], rank0["vocab_size"], args.max_n,
                                 args.random_seed)
        metrics = ServerMetrics()
        manager = TokenizerManager(builder, paths, metrics, procs,
                                   grammar=GrammarChecker(GrammarLimits.from_args(args)))
        drain = Drain(manager, args.graceful_shutdown_timeout)
        manager.drain = drain
        manager.queue_limit = QueueLimit(args.max_queued_requests, args.max_running_requests)

        def server_info() -> dict[str, Any]:
            return {"server_args": resolved_server_args(server_args_dict(args), settings), "version": _version(),
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
        # log_config=None: uvicorn's records (its access log) go through this process's
        # handler, in pdserve's format (pdserve/logs.py), not uvicorn's own.
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                log_config=None, timeout_graceful_shutdown=5,
                                http=protocol_class(args.request_read_timeout, args.send_timeout),
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                                timeout_keep_alive=min(5.0, args.request_read_timeout))
        quiet_uvicorn(args.log_level)  # after Config, which sets uvicorn's loggers up
        role = "colocated" if args.disaggregation_mode == "null" else args.disaggregation_mode
        where = (f" (bootstrap port {args.disaggregation_bootstrap_port})"
                 if args.disaggregation_mode == "prefill" else "")
        server = _Server(config, drain, f"pdserve {role} server ready on http://{args.host}:{args.port}{where}",
                         label, sigint_ignored)
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
