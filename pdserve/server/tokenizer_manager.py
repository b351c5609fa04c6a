"""The HTTP process's side of the pipeline: submit requests, route updates back.

One asyncio task reads every message addressed to the HTTP process (text
updates from the detokenizer, replies from the scheduler) and hands each to
the waiting request. A watchdog notices a dead child process at once: every
in-flight request then ends with an error and /health turns unhealthy.

What a request's state and its pending updates are (`RequestState`, `Updates`, `Job`)
is request_state.py's: data without sockets, re-exported here for the routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence, TypeVar

import zmq
import zmq.asyncio

from pdserve.requests import RequestBuilder
from pdserve.scheduler.messages import Command, NewRequest
from pdserve.server import ipc
from pdserve.server.drain import Drain, QueueLimit
from pdserve.server.grammar_check import GrammarChecker
from pdserve.server.messages import Reply, TextBatch, TextUpdate
from pdserve.server.metrics import ServerMetrics
from pdserve.server.request_state import Job, RequestState, SampleResult, Updates

__all__ = ["EARLY_ABORT_S", "ClientGone", "Job", "RequestState", "SampleResult", "ServerUnavailable",
           "TokenizerManager", "Updates"]

logger = logging.getLogger(__name__)


class ServerUnavailable(RuntimeError):
    pass


# How long an admin's abort waits for a request that has not reached this process yet
# (see `TokenizerManager.abort`): a PD router aborts the other leg of a failed request,
# which left the router at the same moment and is at most a network hop behind.
EARLY_ABORT_S = 2.0
# Threads that tokenize prompts and render chat templates, off the event loop.
PREPARE_THREADS = 2

T = TypeVar("T")


class ClientGone(Exception):
    """The client of a non-streaming request disconnected; its prompts were aborted."""


class TokenizerManager:
    def __init__(self, builder: RequestBuilder, paths: ipc.IpcPaths, metrics: ServerMetrics,
                 children: list[Any], grammar: GrammarChecker | None = None) -> None:
        self.builder = builder
        self.tokenizer = builder.tokenizer
        self.metrics = metrics
        self.children = children
        self.ctx = zmq.asyncio.Context()
        self.to_scheduler = ipc.socket(self.ctx, zmq.PUSH, paths.scheduler, bind=False)
        self.inbox = ipc.socket(self.ctx, zmq.PULL, paths.http, bind=True)
        self.requests: dict[str, RequestState] = {}
        # id(job) -> the jobs whose updates a consumer is taking (`stream`), until it is
        # done: a stream's samples count as in flight until its client has taken them.
        self.delivering: dict[int, Job] = {}
        # rid -> whether it was aborted, for the requests being tokenized (not yet submitted).
        self.preparing: dict[str, bool] = {}
        # rid -> when an admin's abort for it arrived before the request did.
        self.early_aborts: dict[str, float] = {}
        self.executor = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="pdserve-prepare")
        # Grammar checks run on their own thread, not on the tokenizing ones (off_loop), with
        # the server's --grammar-* limits (launch passes them).
        self.grammar = grammar if grammar is not None else GrammarChecker()
        self.replies: dict[str, asyncio.Future] = {}
        self.query_lock = asyncio.Lock()
        self.dead_reason: str | None = None
        self.closed = False  # the sockets are gone (shutdown): nothing more is sent
        self._tasks: list[asyncio.Task] = []
        # Admission (pdserve/server/drain.py), set by launch: a draining server refuses
        # new requests; --max-queued-requests bounds what waits for a running slot.
        self.drain: Drain | None = None
        self.queue_limit: QueueLimit | None = None

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._watchdog())]

    async def close(self) -> None:
        self.closed = True
        for t in self._tasks:
            t.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.grammar.close()
        self.ctx.destroy(linger=0)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a preparing thread: tokenization and template rendering take time
        in proportion to what a client sent, and the event loop serves everyone. The grammars
        it meets (json_schema, regex, ebnf) are parsed on the grammar thread instead
        (server/grammar_check.py): a slow schema never holds a tokenizing thread."""
        loop = asyncio.get_running_loop()
        result, pending = await loop.run_in_executor(self.executor, functools.partial(self.grammar.build, fn, *args))
        if not pending:
            return result
        # The request's grammars, parsed on the grammar thread (grammar_check.py). An
        # invalid or slow one: build again, which raises the error as its caller names it.
        failures = await self.grammar.resolve(pending)
        if failures:
            await loop.run_in_executor(self.executor, functools.partial(self.grammar.build, fn, *args,
                                                                        failures=failures))
            raise ValueError(next(iter(failures.values())))  # (not reached: the build raised)
        return result

    @contextlib.contextmanager
    def preparing_rids(self, rids: Sequence[str]) -> Iterator[None]:
        """Around building and submitting a request whose client named its rids: an abort
        that arrives meanwhile is kept and applied on submission. Raises ValueError if a
        rid is already in flight (before any tokenizing is spent on it)."""
        busy = [r for r in rids if r in self.requests or r in self.preparing]
        if busy:
            raise ValueError(f"rid: {busy[0]!r} is already in flight")
        self.preparing.update((r, False) for r in rids)
        try:
            yield
        finally:
            for r in rids:
                self.preparing.pop(r, None)

    # ---- submitting -----------------------------------------------------------------
    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise ServerUnavailable(self.dead_reason)

    async def submit(self, requests: Sequence[NewRequest]) -> Job:
        """Send the prompts of one HTTP request (built and validated by the RequestBuilder).
        Raises ValueError if a rid is already in flight, ServerUnavailable if the server died,
        drain.Refused while draining or when the queue is full."""
        self.check_alive()
        # No await between this check and the insertion below: concurrent submissions
        # are counted one after the other, so a burst cannot overshoot the limit.
        if self.drain is not None:
            self.drain.check()
        if self.queue_limit is not None:
            self.queue_limit.check(self.in_flight_samples(), sum(m.params.n for m in requests))
        live = [m.rid for m in requests if m.rid in self.requests]
        if live:
            raise ValueError(f"rid: {live[0]!r} is already in flight")
        queue = Updates()
        states = [RequestState(m.rid, list(m.prompt_ids), m.params, [SampleResult(j) for j in range(m.params.n)],
                               queue, return_logprob=m.return_logprob, top_logprobs_num=m.top_logprobs_num,
                               logprob_start_len=m.logprob_start_len)
                  for m in requests]
        for state in states:
            self.requests[state.rid] = state
        # The grammars go as the EBNF parsed here: the scheduler does not parse them again.
        await self.to_scheduler.send(ipc.dumps(Command(add=tuple(self.grammar.to_scheduler(m) for m in requests))))
        overtaken = tuple(st.rid for st in states if self._early_abort(st.rid) or self.preparing.get(st.rid))
        if overtaken:
            await self.to_scheduler.send(ipc.dumps(Command(abort=overtaken)))
        return Job(states, queue)

    def in_flight_requests(self) -> int:
        """Prompts submitted and not yet delivered (what a drain waits for): a stream whose
        client has not taken its end yet is still in flight after the scheduler finished it,
        so a drain does not cut it off."""
        return len(self.requests) + sum(1 for job in self.delivering.values() for st in job.states
                                        if self.requests.get(st.rid) is not st)

    def in_flight_samples(self) -> int:
        """Samples submitted and not yet delivered: each needs a scheduler slot while it
        runs, and a stream whose client has not taken its end yet (one that does not read
        keeps it up to --send-timeout) still holds its connection and the samples' output
        here, so it counts toward --max-queued-requests until then."""
        live = sum(len(st.samples) for st in self.requests.values())
        return live + sum(len(st.samples) for job in self.delivering.values() for st in job.states
                          if self.requests.get(st.rid) is not st)

    async def abort_all(self, reason: str) -> int:
        """End every request in flight now: its handler gets ServerUnavailable(reason) (its
        one final outcome; later updates for it are dropped) and the scheduler aborts it,
        freeing its KV. Returns how many prompts were cut off."""
        states = list(self.requests.values())
        if not states:
            return 0
        self.requests.clear()
        for queue in {id(s.queue): s.queue for s in states}.values():
            queue.put_nowait(reason)
        for _ in states:
            self.metrics.requests.labels(finish="abort").inc()
        if self.dead_reason is None and not self.closed:
            await self.to_scheduler.send(ipc.dumps(Command(abort=tuple(s.rid for s in states))))
        return len(states)

    def _early_abort(self, rid: str) -> bool:
        """Whether an abort for `rid` overtook it within EARLY_ABORT_S (forgotten once asked)."""
        at = self.early_aborts.pop(rid, None)
        return at is not None and time.monotonic() - at <= EARLY_ABORT_S

    async def abort(self, rid: str, remember: bool = False) -> bool:
        """Abort a request that is live or being prepared (tokenized; it ends aborted once
        submitted). Returns whether there was one.

        An abort for a rid this process has not seen is kept (EARLY_ABORT_S, for the first
        request with that rid) only when ``remember``: the caller holds the admin key, as a
        PD router does when it aborts a leg that may still be on its way. Any other caller
        could otherwise poison a rid another client will use; it races nothing it may abort
        (a router without the admin key asks again until the rid is seen)."""
        if rid in self.requests:
            if not self.closed:  # (a handler cancelled at shutdown: its scheduler is going too)
                await self.to_scheduler.send(ipc.dumps(Command(abort=(rid,))))
            return True
        if rid in self.preparing:
            self.preparing[rid] = True
            return True
        if remember:
            now = time.monotonic()
            for old in [r for r, t in self.early_aborts.items() if now - t > EARLY_ABORT_S]:
                del self.early_aborts[old]
            self.early_aborts[rid] = now
        return False

    async def stream(self, job: Job) -> AsyncIterator[tuple[RequestState, TextUpdate]]:
        """Yield (state, update) until every prompt of the job has finished. If the
        consumer stops early (the client went away), the unfinished prompts are aborted."""
        # Count final updates as they are consumed: sample state is updated when a
        # message arrives, possibly before earlier queued updates have been yielded.
        unfinished = sum(len(st.samples) for st in job.states)
        self.delivering[id(job)] = job
        try:
            while unfinished:
                item = await job.queue.get()
                if isinstance(item, str):  # the server failed under us
                    for state in job.states:
                        state.error = item
                    raise ServerUnavailable(item)
                state, update = item
                if update.token.finish is not None:
                    unfinished -= 1
                yield state, update
        finally:
            self.delivering.pop(id(job), None)  # (before any await: even if cancelled again)
            for state in job.states:
                if not state.finished:
                    await self.abort(state.rid)

    async def wait(self, job: Job, client_gone: Awaitable[None] | None = None) -> Job:
        """Until every prompt finished. ``client_gone`` completes when the client of a
        non-streaming request disconnects: then the unfinished prompts are aborted
        (``stream`` does that when it is stopped) and ``ClientGone`` is raised."""
        async def consume() -> Job:
            async for _ in self.stream(job):
                pass
            return job
        if client_gone is None:
            return await consume()
        task, watcher = asyncio.ensure_future(consume()), asyncio.ensure_future(client_gone)
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone()
        finally:
            watcher.cancel()

    # ---- queries --------------------------------------------------------------------
    async def query(self, cmd: Command, kind: str, timeout: float = 30.0) -> Any:
        self.check_alive()
        async with self.query_lock:
            fut = asyncio.get_running_loop().create_future()
            self.replies[kind] = fut
            await self.to_scheduler.send(ipc.dumps(cmd))
            try:
                return await asyncio.wait_for(fut, timeout)
            finally:
                self.replies.pop(kind, None)

    async def get_state(self) -> dict[str, Any]:
        return await self.query(Command(get_state=True), "state")

    async def flush_cache(self) -> bool:
        flushed = bool(await self.query(Command(flush_cache=True), "flushed"))
        if flushed:
            self.grammar.flush()  # (the scheduler flushed its compiled grammars too)
        return flushed

    # ---- background -----------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while True:
            msg = ipc.loads(await self.inbox.recv())
            if isinstance(msg, Reply):
                fut = self.replies.get(msg.kind)
                if fut is not None and not fut.done():
                    fut.set_result(msg.payload)
            elif isinstance(msg, TextBatch):
                now = time.perf_counter()
                for update in msg.updates:
                    self._route(update, now)

    def _route(self, update: TextUpdate, now: float) -> None:
        tok = update.token
        state = self.requests.get(tok.rid)
        if state is None:
            return
        sample = state.samples[tok.index]
        sample.text += update.text_delta
        sample.output_ids.extend(tok.new_ids)
        sample.logprobs.extend(tok.new_logprobs)
        sample.top_logprobs.extend(tok.new_top_logprobs)
        if tok.input_logprobs is not None:
            sample.input_logprobs = tok.input_logprobs
            sample.input_top_logprobs = tok.input_top_logprobs
        sample.prompt_tokens = tok.prompt_tokens
        sample.cached_tokens = tok.cached_tokens
        sample.retractions = tok.retractions
        sample.spec_verify_ct = tok.spec_verify_ct
        sample.spec_accepted_drafts = tok.spec_accepted_drafts
        if tok.new_ids:
            if state.first_token_at is None:
                state.first_token_at = now
                self.metrics.ttft.observe(now - state.created)
            elif state.last_token_at is not None:
                self.metrics.itl.observe((now - state.last_token_at) / len(tok.new_ids))
            state.last_token_at = now
            self.metrics.generation_tokens.inc(len(tok.new_ids))
        if tok.finish is not None:
            sample.finish = tok.finish
            if sample.index == 0:
                self.metrics.prompt_tokens.inc(tok.prompt_tokens * len(state.samples))
        if state.finished:
            self.metrics.e2e.observe(now - state.created)
            self.metrics.requests.labels(finish=_finish_kind(state)).inc()
            del self.requests[state.rid]
        state.queue.put_nowait((state, update))

    async def _watchdog(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(0.2)
            dead = [p for p in self.children if not p.is_alive()]
            if dead:
                self.dead_reason = (f"server process {dead[0].name} died (exit code {dead[0].exitcode}); "
                                    "the server cannot serve requests")
                logger.error(self.dead_reason)
                for queue in {id(s.queue): s.queue for s in self.requests.values()}.values():
                    queue.put_nowait(self.dead_reason)
                self.requests.clear()
                for fut in self.replies.values():
                    if not fut.done():
                        fut.set_exception(ServerUnavailable(self.dead_reason))


def _finish_kind(state: RequestState) -> str:
    kinds = {s.finish.get("type", "abort") for s in state.samples if s.finish}
    return "abort" if "abort" in kinds else ("length" if kinds == {"length"} else "stop")
