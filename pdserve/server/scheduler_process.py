"""The scheduler process of a server: rank 0 talks ZMQ, other ranks follow over TP."""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq

from pdserve import logs
from pdserve.config import ServerArgs
from pdserve.scheduler.messages import Command
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import StepOutput
from pdserve.scheduler.worker import IDLE_WAKEUP_S, run_rank
from pdserve.server import ipc
from pdserve.server.messages import Reply, TokenBatch, TokenUpdate


class ZmqIO:
    """Commands from the HTTP process in; token updates to the detokenizer, replies to HTTP."""

    def __init__(self, paths: ipc.IpcPaths) -> None:
        self.ctx = zmq.Context()
        self.commands = ipc.socket(self.ctx, zmq.PULL, paths.scheduler, bind=True)
        self.to_detokenizer = ipc.socket(self.ctx, zmq.PUSH, paths.detokenizer, bind=False)
        self.to_http = ipc.socket(self.ctx, zmq.PUSH, paths.http, bind=False)
        self.sent: dict[tuple[str, int], int] = {}  # tokens already published per sample

    def receive(self, block: bool) -> list[Command]:
        cmds = []
        if block:  # at most IDLE_WAKEUP_S (the followers wait in a collective meanwhile)
            self.commands.poll(int(IDLE_WAKEUP_S * 1000))
        while True:
            try:
                cmds.append(ipc.loads(self.commands.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return cmds

    def reply(self, kind: str, payload: Any) -> None:
        self.to_http.send(ipc.dumps(Reply(kind, payload)))

    def publish(self, out: StepOutput) -> None:
        seen: set[int] = set()
        updates = []
        for req in out.advanced + out.finished:
            if id(req) in seen:
                continue
            seen.add(id(req))
            updates.append(self._update(req))
        self.to_detokenizer.send(ipc.dumps(TokenBatch(tuple(updates))))

    def _update(self, req: Req) -> TokenUpdate:
        key = (req.rid, req.sample_index)
        first = key not in self.sent
        start = self.sent.get(key, 0)
        end = len(req.output_ids)
        if req.finished:
            self.sent.pop(key, None)
        else:
            self.sent[key] = end
        lps = tuple(req.output_logprobs[start:end]) if req.return_logprob else ()
        tops = tuple(tuple(t) for t in req.output_top_logprobs[start:end]) if req.top_logprobs_num else ()
        return TokenUpdate(
            rid=req.rid, index=req.sample_index, new_ids=tuple(req.output_ids[start:end]),
            new_logprobs=lps, new_top_logprobs=tops,
            finish=req.finish.to_dict() if req.finish is not None else None,
            prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens,
            completion_tokens=end, retractions=req.retractions, spec_verify_ct=req.spec_verify_ct,
            spec_accepted_drafts=req.spec_accepted_drafts, params=req.params if first else None,
            input_logprobs=tuple(req.input_logprobs) if first and req.input_logprobs is not None else None,
            input_top_logprobs=tuple(None if t is None else tuple(t) for t in req.input_top_logprobs)
            if first and req.input_top_logprobs is not None else None)


def die_with_parent() -> None:
    """Children must never outlive the server process, even if it is SIGKILLed."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    # Ctrl-C in the terminal reaches the whole process group; the parent decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _severity(level: str) -> int:
    return logging.getLevelName(level.upper())  # type: ignore[no-any-return]


def make_zmq_io(paths: ipc.IpcPaths) -> ZmqIO:
    return ZmqIO(paths)


def run_scheduler_process(args: ServerArgs, model_dir: Path, tokenizer_dir: Path, rank: int,
                          init_method: str, paths: ipc.IpcPaths | None, ready: Connection) -> None:
    die_with_parent()
    label = logs.server_label(args.disaggregation_mode)
    logs.set_process_title(f"scheduler TP{rank}", label)
    # The ranks log the same startup details: rank 0 says them, the others only their
    # warnings and errors (all of it with --log-level debug).
    level = args.log_level if rank == 0 or args.log_level == "debug" else max(args.log_level, "warning", key=_severity)
    logs.configure(level, logs.tp_label(label, rank))
    import functools

    make_io = functools.partial(make_zmq_io, paths) if rank == 0 and paths is not None else None
    try:
        run_rank(args, model_dir, tokenizer_dir, rank, init_method, make_io, ready)
    except KeyboardInterrupt:
        pass
    os._exit(0)
