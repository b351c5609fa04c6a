"""A scheduler rank: builds the runner and scheduler, then runs the TP lockstep loop.

Every rank runs an identical scheduler. Rank 0 receives commands (new
requests, aborts, queries) through its `RankIO` and broadcasts them; all ranks
then take the same step, so their scheduling decisions and KV layouts agree
without further messages (sampled tokens are broadcast from rank 0 inside the
step). The IO is a pipe for the offline engine and ZMQ for the server.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from pdserve.config import ServerArgs, flag
from pdserve.model.parallel import TPGroup, bind_device, init_tp_group
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.messages import Command
from pdserve.scheduler.mode import mode_builder
from pdserve.scheduler.req import FinishKind, FinishReason, Req, samples_from_message
from pdserve.scheduler.scheduler import Scheduler, StepOutput
from pdserve.scheduler.grammar import GrammarBackend, GrammarLimits
from pdserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


# The longest rank 0 waits for a command before it broadcasts an empty one anyway. The
# other ranks wait inside that broadcast, and a gloo collective fails after the group's
# deadline (torch's default: 30 minutes): an idle server must not lose its followers.
IDLE_WAKEUP_S = 60.0


class RankIO(Protocol):
    """Rank 0's link to whoever drives it."""

    def receive(self, block: bool) -> list[Command]:
        """The pending commands; with ``block``, waiting up to IDLE_WAKEUP_S for one."""
        ...

    def reply(self, kind: str, payload: Any) -> None: ...

    def publish(self, out: StepOutput) -> None: ...


class PipeIO:
    """The offline engine's link: commands in, finished requests out."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def receive(self, block: bool) -> list[Command]:
        cmds = []
        if self.conn.poll(IDLE_WAKEUP_S if block else 0):
            cmds.append(self.conn.recv())
            while self.conn.poll():
                cmds.append(self.conn.recv())
        return cmds

    def reply(self, kind: str, payload: Any) -> None:
        self.conn.send((kind, payload))

    def publish(self, out: StepOutput) -> None:
        if out.finished:
            self.conn.send(("finished", [detached(r) for r in out.finished]))


def build_scheduler(args: ServerArgs, model_dir: Path, tokenizer_dir: Path, tp: TPGroup) -> Scheduler:
    tokenizer = load_tokenizer(tokenizer_dir)

    def decode_text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    runner = ModelRunner(args, model_dir, tp)
    if args.disaggregation_mode == "null":
        sched = Scheduler(args, runner, decode_text, tp)
    else:  # a prefill or decode side composed in (pdserve/disagg/build.py)
        sched = mode_builder(args.disaggregation_mode)(args, runner, decode_text, tp)
    sched.grammars = GrammarBackend(tokenizer, runner.config.vocab_size, runner.config.eos_token_ids,
                                    GrammarLimits.from_args(args))
    return sched


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tp_init_method(args: ServerArgs) -> str:
    """Where the TP group meets: --dist-init-addr (every node dials node 0 there), else
    a free loopback port of this machine (all ranks are its processes)."""
    host_port = args.dist_init_host_port()
    if host_port is None:
        return f"tcp://127.0.0.1:{free_tcp_port()}"
    host, port = host_port
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# Flags that may differ between the nodes of one instance: this node's rank, its own
# addresses and paths (a checkpoint may live elsewhere on each machine), its logging.
NODE_LOCAL_FIELDS = frozenset({"node_rank", "host", "port", "model_path", "tokenizer_path",
                               "speculative_draft_model_path", "chat_template", "disaggregation_secret_file",
                               "disaggregation_ib_device", "log_level"})


def check_same_command(args: ServerArgs, tp: TPGroup) -> None:
    """Every node must run node 0's command but for its --node-rank (and NODE_LOCAL_FIELDS):
    ranks built from other flags would diverge silently. Rank 0 broadcasts digests of its
    flags (never their values: secrets among them); every rank learns whether any rank
    differs, so each node fails with a message rather than leaving the others hanging."""
    if args.nnodes == 1:
        return
    mine = {f.name: hashlib.sha256(repr(getattr(args, f.name)).encode()).hexdigest()
            for f in dataclasses.fields(args) if f.name not in NODE_LOCAL_FIELDS}
    theirs: dict[str, str] = tp.broadcast_object(mine)  # type: ignore[assignment]
    differ = sorted(k for k in mine if theirs.get(k) != mine[k])
    anyone = tp.all_reduce(torch.tensor([1.0 if differ else 0.0]))
    if differ:
        raise RuntimeError(f"node {args.node_rank}'s command differs from node 0's in "
                           f"{', '.join(flag(k) for k in differ)}: every node runs the same command but "
                           "for --node-rank")
    if anyone.item():
        raise RuntimeError("another node's command differs from this node's (its output names the flags): "
                           "every node runs the same command but for --node-rank")


def run_rank(args: ServerArgs, model_dir: Path, tokenizer_dir: Path, rank: int, init_method: str,
             make_io: Callable[[], RankIO] | None, ready: Connection | None = None) -> None:
    """Entry point of a scheduler process. Rank 0 builds its IO with `make_io` (in
    this process: sockets must not cross a fork) and reports ("ready", info) or
    ("error", traceback) on `ready` (or through the IO's reply if no pipe is given)."""
    local_ranks = args.node_tp_ranks()
    if len(local_ranks) > 1 and "OMP_NUM_THREADS" not in os.environ:  # this node's ranks split its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(local_ranks)))
    io = make_io() if make_io is not None else None
    report = (lambda kind, payload: ready.send((kind, payload))) if ready is not None else (
        io.reply if io is not None else None)
    try:
        # On CUDA this rank's GPU (its index on this node) becomes the current device first.
        device = bind_device(rank - local_ranks.start, args.resolved_device())
        tp = init_tp_group(rank, args.tp_size, init_method, device, timeout_s=args.rendezvous_timeout())
        check_same_command(args, tp)
        sched = build_scheduler(args, model_dir, tokenizer_dir, tp)
        # Ready means the whole group is: rank 0 (whose report opens the HTTP server)
        # gets past this only once every rank on every node has built its scheduler.
        tp.barrier()
    except Exception:
        if report is not None:
            hint = ("\n(the TP group spans nodes: a rank on another node may have failed or stopped; "
                    "see that node's output)" if args.nnodes > 1 else "")
            report("error", traceback.format_exc() + hint)
        raise
    if report is not None:
        report("ready", {"context_len": sched.context_len, "vocab_size": sched.vocab_size,
                         "pid": os.getpid(), "settings": sched.settings()})
    serve(sched, tp, io)


def serve(sched: Scheduler, tp: TPGroup, io: RankIO | None) -> None:
    while True:
        if io is not None:
            cmd = Command.merge(io.receive(block=not sched.has_work))
            tp.broadcast_object(cmd)
        else:
            cmd = tp.broadcast_object(None)  # type: ignore[assignment]
        if cmd.shutdown:
            break
        out = StepOutput()
        for msg in cmd.add:
            samples = samples_from_message(msg)  # every rank builds the same Reqs from the message
            try:
                sched.add(samples[0])
            except Exception as exc:  # one request never ends the loop
                # ValueError / RuntimeError: the request itself is refused (a room in use,
                # a bad address); anything else is our bug, reported as a server error.
                refused = isinstance(exc, (ValueError, RuntimeError))
                if not refused:
                    logger.exception("adding request %s failed", msg.rid)
                for sample in samples:
                    sample.finish = FinishReason(FinishKind.ABORT, server_error=not refused,
                                                 message=str(exc) if refused else f"internal error: {exc}")
                    out.finished.append(sample)
                samples[0].pending_forks = []
        for rid in cmd.abort:
            try:
                out.finished += sched.abort(rid)
            except Exception:
                logger.exception("aborting %s failed", rid)
                for req in [r for r in sched.live_requests() if r.rid == rid]:
                    out.finished += sched.fail_request(req, "aborting it failed")
        if cmd.flush_cache and io is not None:
            io.reply("flushed", sched.flush_cache())
        elif cmd.flush_cache:
            sched.flush_cache()
        if cmd.get_state and io is not None:
            io.reply("state", sched.state())
        forwards = sched.num_forward_steps
        try:
            step = sched.step()
        except Exception as exc:  # outside every request's guard: end them all, keep serving
            logger.exception("scheduler step failed")
            step = StepOutput(finished=sched.fail_all(f"scheduler step failed: {exc}"))
        out.advanced += step.advanced
        out.finished += step.finished
        if io is not None and (out.advanced or out.finished):
            io.publish(out)
        if sched.has_work and sched.num_forward_steps == forwards and not out.advanced and not out.finished:
            time.sleep(0.001)  # only waiting on transfers: do not spin
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def detached(req: Req) -> Req:
    """A finished request without scheduler-owned handles, safe to pickle."""
    req.lock_node = None
    req.pending_forks = []
    req.grammar = None
    return req
