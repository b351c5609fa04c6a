"""Constrained decoding: grammars checked where requests arrive, compiled off the step,
one matcher per request.

A request with ``json_schema``, ``regex`` or ``ebnf`` has its grammar's work bounded at
every stage, so that no grammar can stall other requests (issue 39):

- Where a request arrives over HTTP (``server/grammar_check.py``), the text is measured
  before anything parses it: more than ``--grammar-max-bytes`` bytes, or nested deeper than
  ``--grammar-max-depth`` (xgrammar's parse time grows with the cube of the depth), is a
  400 naming the flag (``check_limits``). The parse itself runs on the HTTP process's own
  grammar thread, never on the threads that tokenize, within ``--grammar-compile-timeout``,
  and the parsed grammar travels to the scheduler as EBNF (``canonical_ebnf``), whose
  parse is linear: a schema is parsed once.
- A scheduler's ``GrammarBackend`` compiles off the scheduler thread (xgrammar releases
  the GIL): grammars up to ``INLINE_BYTES`` of text on a small thread pool (they compile
  in milliseconds), larger ones in a worker process (``grammar_worker.py``) that is killed
  as soon as no live request waits for its compile (the clients left, or every waiting
  request passed ``--grammar-compile-timeout``), so an abandoned large compile costs
  nothing more (a small one not started yet is dropped). Admission passes a request by
  until its grammar is ready (a decode server parks a request whose KV arrived first,
  ``disagg/decode_side.py``), and ends it, alone, with a message naming the flag once its
  deadline passes; TP ranks agree on both (``Scheduler.settle_grammars``).
- Both processes cache by a SHA-256 digest of the text (never the text itself as key),
  bounded in bytes by ``--grammar-cache-bytes``; ``/flush_cache`` empties the caches.

The code is in three modules, split where its users split:

- ``grammar_text.py``: limits, digests, parsing and checking grammar *text*, and the
  ``ByteLRU`` both processes cache with. No tokenizer, no compiler, no torch: what the
  HTTP process, ``requests.py`` and the worker process need.
- this module: ``GrammarBackend``, a scheduler's compiler (threads, worker process,
  cache of compiled grammars, cancelling compiles nobody waits for).
- ``grammar_state.py``: what one request holds, ``GrammarState`` (its matcher, following
  its output lazily) and the packed bitmask rows it fills (``new_bitmask``).

Every public name of the three is importable from here, where callers always found them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.grammar_state import COMPILING, FAILED, READY, GrammarState, new_bitmask
from pdserve.scheduler.grammar_text import (CHECKED_ENTRIES, ENTRY_OVERHEAD, FLAG_BYTES, FLAG_DEPTH, FLAG_TIMEOUT,
                                            ByteLRU, Deferral, GrammarLimits, canonical_ebnf, check_constraint,
                                            check_limits, deferring, digest, nesting_depth, parse_grammar)

__all__ = [
    # grammar_text
    "CHECKED_ENTRIES", "ENTRY_OVERHEAD", "FLAG_BYTES", "FLAG_DEPTH", "FLAG_TIMEOUT", "ByteLRU", "Deferral",
    "GrammarLimits", "canonical_ebnf", "check_constraint", "check_limits", "deferring", "digest", "nesting_depth",
    "parse_grammar",
    # grammar_state
    "COMPILING", "FAILED", "READY", "GrammarState", "new_bitmask",
    # this module
    "INLINE_BYTES", "INLINE_THREADS", "GrammarBackend",
]

logger = logging.getLogger(__name__)

# Grammars up to this many characters of text compile on the scheduler process's threads
# (milliseconds: an enum of a few thousand strings); larger ones (an enum of 20,000 strings
# compiles for seconds and takes tens of MB) in the worker process, whose compile can be
# stopped (a thread's cannot).
INLINE_BYTES = 32 << 10
INLINE_THREADS = 2


# ---- the scheduler's compiler --------------------------------------------------------------
class _Job:
    """One grammar being compiled, for every request that waits for it."""

    def __init__(self, key: bytes, kind: str, text: str) -> None:
        self.key, self.kind, self.text = key, kind, text
        self.future: Future[Any] = Future()  # never set running: cancel() works until a result is set
        self.waiters: weakref.WeakSet[GrammarState] = weakref.WeakSet()
        self.pinned = False  # compile() was asked directly (no request to follow): never cancelled
        self.expired = False  # a request ended waiting for it past its deadline (a timeout, not a cancel)


class GrammarBackend:
    """A scheduler's grammar compiler: the tokenizer's vocabulary as xgrammar sees it,
    compile threads and the worker process, and the compiled grammars of recent
    requests (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int],
                 limits: GrammarLimits = GrammarLimits()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self.limits = limits
        self._lock = threading.Lock()   # the cache, the jobs, the queue (held briefly: the scheduler takes it)
        self._wake = threading.Condition(self._lock)
        self._build_lock = threading.Lock()  # building the vocabulary scan and the threads' compiler (slow)
        self._info: Any = None       # xgrammar's TokenizerInfo: the vocabulary scan, at first use
        self._info_json: str | None = None  # ... serialized for the worker process
        self._compiler: Any = None   # the threads' GrammarCompiler
        self._cache: ByteLRU[Any] = ByteLRU(limits.cache_bytes)  # digest -> CompiledGrammar
        self._jobs: dict[bytes, _Job] = {}                       # digest -> compile under way
        self._threads = ThreadPoolExecutor(INLINE_THREADS, thread_name_prefix="grammar")
        self._queue: collections.deque[_Job] = collections.deque()  # for the worker process
        self._dispatcher: threading.Thread | None = None
        self._process: Any = None    # grammar_worker.CompileProcess
        self._closed = False
        self.counts = collections.Counter[str]()  # compiled, failed, cancelled, timed_out, worker_starts

    # ---- asking for grammars ----------------------------------------------------------
    def compile(self, kind: str, text: str) -> "Future[Any]":
        """The compiled grammar of ``(kind, text)``, to be waited for (never cancelled)."""
        return self._submit(kind, text, None)

    def state(self, params: SamplingParams) -> "GrammarState | None":
        """A request's matcher-to-be: its compile starts (or is shared) now and its
        deadline runs from now."""
        constraint = params.constraint
        if constraint is None:
            return None
        state = GrammarState(None, kind=constraint[0], timeout=self.limits.timeout)  # type: ignore[arg-type]
        state.compiled = self._submit(*constraint, state)
        return state

    def _submit(self, kind: str, text: str, waiter: "GrammarState | None") -> "Future[Any]":
        key = digest(kind, text)
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is closed")
            hit = self._cache.get(key)
            if hit is not None:
                done: Future[Any] = Future()
                done.set_result(hit)
                return done
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = _Job(key, kind, text)
                if len(text) <= INLINE_BYTES:
                    self._threads.submit(self._compile_inline, job)
                else:
                    self._queue.append(job)
                    self._wake.notify()
            self._start_dispatcher()
            if waiter is None:
                job.pinned = True
            else:
                job.waiters.add(waiter)
                waiter.job = job
            return job.future

    # ---- compiling ----------------------------------------------------------------------
    def _tokenizer_info(self) -> Any:
        import xgrammar as xgr

        with self._build_lock:
            if self._info is None:
                self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self.stop_ids)
            return self._info

    def _compile_inline(self, job: _Job) -> None:
        import xgrammar as xgr

        if self._take_orphan(job):
            return
        try:
            info = self._tokenizer_info()
            with self._build_lock:
                if self._compiler is None:
                    # Our own cache (bounded, by digest) instead of xgrammar's: unbounded, and
                    # with it a large grammar compiles several times slower.
                    self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                compiler = self._compiler
            compiled = compiler.compile_grammar(parse_grammar(job.kind, job.text))
        except Exception as exc:  # noqa: BLE001 - the request reports it
            self._finish(job, error=exc)
            return
        self._finish(job, compiled=compiled)

    def _start_dispatcher(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = threading.Thread(target=self._dispatch, name="grammar-dispatch", daemon=True)
            self._dispatcher.start()

    def _dispatch(self) -> None:
        """The worker process's jobs, one at a time; a job nobody waits for any more is
        dropped before it starts or killed while it runs. The process starts with the
        scheduler's first constrained request and again right after a kill, so a large
        grammar seldom waits for a start (seconds: the process imports torch)."""
        import xgrammar as xgr

        from pdserve.scheduler.grammar_worker import CompileProcess

        start_failed = False  # (then a new start is tried only for a job)
        while True:
            with self._wake:
                while not self._queue and not self._closed and (self._process is not None or start_failed):
                    self._wake.wait()
                if self._closed:
                    return
                job = self._queue.popleft() if self._queue else None
            if job is not None and self._take_orphan(job):
                continue
            try:
                if self._process is None or not self._process.alive():
                    self._process = None
                    self._new_process(CompileProcess)
                start_failed = False
            except Exception as exc:  # noqa: BLE001 - reported to the job's requests, if any
                if self._closed:
                    return  # (closed while it started: nothing to report)
                logger.exception("starting the grammar worker process failed")
                start_failed = True
                if job is not None:
                    self._finish(job, error=RuntimeError(f"the grammar compiler process did not start: {exc}"))
                continue
            if job is None:
                continue
            process = self._process
            try:
                result = process.compile(job.kind, job.text, lambda: self._closed or self._take_orphan(job))
                if result is None:  # stopped (nobody waits): the process was killed
                    self._process = None
                    continue
                ok, payload = result
                if ok:
                    compiled = xgr.CompiledGrammar.deserialize_json(payload, self._info)
                    self._finish(job, compiled=compiled)
                else:
                    self._finish(job, error=ValueError(payload))
            except Exception as exc:  # noqa: BLE001 - the process broke: this job fails, a new process starts
                if self._closed:
                    return  # (close() killed it)
                logger.exception("grammar worker process failed")
                process.kill()
                self._process = None
                self._finish(job, error=RuntimeError(f"the grammar compiler process failed: {exc}"))

    def _new_process(self, factory: Callable[[str], Any]) -> None:
        if self._info_json is None:
            self._info_json = self._tokenizer_info().serialize_json()
        process = factory(self._info_json)
        with self._lock:
            closed = self._closed
            if not closed:
                self._process = process
                self.counts["worker_starts"] += 1
        if closed:
            process.kill()
            raise RuntimeError("the grammar compiler is closed")

    def _orphaned(self, job: _Job, now: float) -> bool:
        return not job.pinned and not any(not s.released and now <= s.deadline for s in list(job.waiters))

    def _take_orphan(self, job: _Job) -> bool:
        """If no live request waits for ``job`` (its requests ended, or each passed its
        deadline), cancel it: True. A request asking for the grammar later compiles anew."""
        now = time.monotonic()
        with self._lock:
            if job.future.done() or not self._orphaned(job, now):
                return False
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            expired = job.expired or any(not s.released for s in list(job.waiters))
            self.counts["timed_out" if expired else "cancelled"] += 1
        job.future.cancel()
        return True

    def _finish(self, job: _Job, compiled: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            if error is None:
                self.counts["compiled"] += 1
                self._cache.put(job.key, compiled, int(compiled.memory_size_bytes) + ENTRY_OVERHEAD)
            else:
                self.counts["failed"] += 1
        if error is None:
            job.future.set_result(compiled)
        else:
            job.future.set_exception(error)

    # ---- inspection and teardown ----------------------------------------------------------
    def flush(self) -> None:
        """Forget every compiled grammar (compiles under way go on for their requests)."""
        with self._lock:
            self._cache.clear()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            process = self._process
            return {"cache_bytes": self._cache.bytes, "cache_entries": len(self._cache),
                    "cache_limit_bytes": self._cache.bound, "compiling": len(self._jobs),
                    "worker_pid": process.pid if process is not None and process.alive() else None,
                    **{k: self.counts[k] for k in ("compiled", "failed", "cancelled", "timed_out",
                                                    "worker_starts")}}

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._threads.shutdown(wait=False, cancel_futures=True)
        process, self._process = self._process, None
        if process is not None:
            process.kill()

