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
  nothing more (a small one not started yet is dropped). Admission passes a request by until its grammar is ready (a decode server parks a
  request whose KV arrived first, ``decode.py``), and ends it, alone, with a message naming
  the flag once its deadline passes; TP ranks agree on both (``Scheduler.settle_grammars``).
- Both processes cache by a SHA-256 digest of the text (never the text itself as key),
  bounded in bytes by ``--grammar-cache-bytes``; ``/flush_cache`` empties the caches.

The matcher follows the request's committed output lazily: before it fills a mask or
judges a stop it accepts whatever tokens the request gained since (a decoded token, a
speculative round's accepted tokens, the first token a prefill server drew across the
split). So no code path that appends output has to know about grammars. A speculative
draw view (the request plus a draft-tree path) gets its mask by accepting the path,
filling, and rolling the path back.

Masks are filled on the host into xgrammar's packed int32 bitmask (1 bit per token) and
go up with the rest of the sampler's inputs; the sampler unpacks them on the device.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import logging
import re
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

import torch

from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Grammars up to this many characters of text compile on the scheduler process's threads
# (milliseconds: an enum of a few thousand strings); larger ones (an enum of 20,000 strings
# compiles for seconds and takes tens of MB) in the worker process, whose compile can be
# stopped (a thread's cannot).
INLINE_BYTES = 32 << 10
INLINE_THREADS = 2
# Known-valid grammars the offline path remembers (digests only: 32 bytes each).
CHECKED_ENTRIES = 4096
# What a cache entry costs beyond its measured value (the key, the dict slot, the object).
ENTRY_OVERHEAD = 200
# xgrammar's messages start with "[time] /path/file.cc:line: "; users need the rest.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'        # (EBNF text, as xgrammar prints it)
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
FLAG_BYTES, FLAG_DEPTH, FLAG_TIMEOUT = "--grammar-max-bytes", "--grammar-max-depth", "--grammar-compile-timeout"

# A grammar's state as the scheduler acts on it. The order matters: TP ranks agree by
# taking the minimum, so a failure on any rank fails it everywhere, and it is ready only
# once it is ready on every rank.
FAILED, COMPILING, READY = 0, 1, 2


@dataclass(frozen=True)
class GrammarLimits:
    """What one grammar may cost (see the module docstring; defaults are the flags')."""
    max_bytes: int = 1 << 20
    max_depth: int = 64
    timeout: float = 30.0          # seconds to parse (HTTP process) and to compile (scheduler), each
    cache_bytes: int = 256 << 20   # each process's grammar cache

    @classmethod
    def from_args(cls, args: Any) -> "GrammarLimits":
        return cls(args.grammar_max_bytes, args.grammar_max_depth, args.grammar_compile_timeout,
                   args.grammar_cache_bytes)


# ---- measuring and parsing grammar text --------------------------------------------------
def digest(kind: str, text: str) -> bytes:
    """The cache key of a grammar: 32 bytes, whatever the size of its text."""
    return hashlib.sha256(kind.encode() + b"\0" + text.encode("utf-8", "surrogatepass")).digest()


# What does not nest, per kind, removed before brackets are counted: JSON strings; a
# regex's escapes and character classes; an EBNF's strings, character classes, comments.
_NOT_NESTING = {
    "json_schema": re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S),
    "regex": re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]", re.S),
    "ebnf": re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*', re.S),
}
_BRACKETS = {"json_schema": ("[{", "]}"), "regex": ("(", ")"), "ebnf": ("(", ")")}


def nesting_depth(kind: str, text: str) -> int:
    """How deeply ``text`` nests: JSON arrays and objects of a schema, parentheses of a
    regex or EBNF grammar. Linear, at C speed (regular expressions and itertools)."""
    opens, closes = _BRACKETS[kind]
    stripped = _NOT_NESTING[kind].sub("", text)
    brackets = re.sub(f"[^{re.escape(opens + closes)}]", "", stripped)
    step = dict.fromkeys(opens, 1) | dict.fromkeys(closes, -1)
    return max(itertools.accumulate(map(step.__getitem__, brackets)), default=0)


def check_limits(kind: str, text: str, limits: GrammarLimits) -> None:
    """Raise ValueError naming the field and the flag when ``text`` is too large or nests
    too deeply to be parsed at a bounded cost (before anything parses it)."""
    if len(text) > limits.max_bytes:  # (characters <= bytes: no need to encode to know)
        raise ValueError(f"{kind}: more than {limits.max_bytes} bytes ({len(text)} characters), "
                         f"above the limit ({FLAG_BYTES})")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"{kind}: is not valid Unicode (unpaired surrogate at position {exc.start})") from None
    if size > limits.max_bytes:
        raise ValueError(f"{kind}: {size} bytes, above the limit of {limits.max_bytes} ({FLAG_BYTES})")
    depth = nesting_depth(kind, text)
    if depth > limits.max_depth:
        raise ValueError(f"{kind}: nested {depth} levels deep, above the limit of {limits.max_depth} "
                         f"({FLAG_DEPTH})")


def _parse(kind: str, text: str) -> Any:
    import xgrammar as xgr

    if kind == "json_schema":
        # Compact JSON: a free-whitespace grammar lets a model pad forever between
        # tokens and run out of budget before the value closes.
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False)
        # xgrammar's strings with minLength / maxLength take any character but quote,
        # backslash, CR and LF, so raw control characters (a tab) make the output
        # invalid JSON (mlc-ai/xgrammar#800); exclude them as its unbounded strings do.
        ebnf = str(grammar)
        fixed = ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)
        return grammar if fixed == ebnf else xgr.Grammar.from_ebnf(fixed)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    raise ValueError(f"{kind}: not a constraint kind")


def parse_grammar(kind: str, text: str) -> Any:
    """xgrammar's Grammar of a constraint; ValueError naming the field with the
    compiler's message when it is invalid."""
    if kind == "json_schema":
        try:
            json.loads(text)
        except RecursionError:  # (the HTTP process refused it by depth before; the Engine did not)
            raise ValueError(f"{kind}: nested too deeply to parse") from None
        except ValueError as exc:
            raise ValueError(f"json_schema: not valid JSON: {exc}") from None
    try:
        return _parse(kind, text)
    except (RuntimeError, ValueError) as exc:
        message = _CPP_PREFIX.sub("", str(exc)).strip().splitlines()[0]
        raise ValueError(f"{kind}: invalid {kind.replace('_', ' ')}: {message}") from None


def canonical_ebnf(kind: str, text: str) -> str:
    """The constraint parsed, as EBNF: what the HTTP process sends the scheduler in place
    of the client's text, so the scheduler re-reads a grammar (linear) instead of parsing
    the schema again (cubic in its depth). ValueError naming the field if invalid."""
    return str(parse_grammar(kind, text))


# ---- checking a request's constraint -------------------------------------------------------
class Deferral:
    """Grammar checks a thread leaves to someone else: the HTTP process builds requests on
    its tokenizing threads and parses grammars on its own grammar thread
    (``server/grammar_check.py``). ``check_constraint`` on a thread inside ``deferring``
    checks only the limits (cheap) and answers from ``lookup`` (digest -> an error message,
    or "" when known valid, or None when unknown); unknown grammars land in ``pending``."""

    def __init__(self, limits: GrammarLimits, lookup: Callable[[bytes], str | None]) -> None:
        self.limits = limits
        self.lookup = lookup
        self.pending: dict[bytes, tuple[str, str]] = {}


_local = threading.local()


@contextlib.contextmanager
def deferring(deferral: Deferral) -> Iterator[Deferral]:
    _local.deferral = deferral
    try:
        yield deferral
    finally:
        _local.deferral = None


def check_constraint(params: SamplingParams) -> None:
    """Raise ValueError naming the field when the request's schema / regex / grammar is
    invalid (the HTTP layer makes it a 400). Inside ``deferring`` (the HTTP process) only
    the limits are checked here and the parse is left to the deferral's owner; elsewhere
    (the offline Engine, whose input is its caller's own) it is parsed now."""
    if params.constraint is None:
        return
    kind, text = params.constraint
    deferral: Deferral | None = getattr(_local, "deferral", None)
    if deferral is not None:
        check_limits(kind, text, deferral.limits)
        key = digest(kind, text)
        known = deferral.lookup(key)
        if known is None:
            deferral.pending[key] = (kind, text)
        elif known:
            raise ValueError(known)
        return
    key = digest(kind, text)
    with _checked_lock:
        if _checked.get(key):
            return
    parse_grammar(kind, text)
    with _checked_lock:
        _checked.put(key, True, 32)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32 packed token masks (xgrammar's layout), every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


# ---- caches --------------------------------------------------------------------------------
V = TypeVar("V")


class ByteLRU(Generic[V]):
    """Digest -> value, least recently used first out, bounded by the bytes its values take
    (as the caller measures them). A value larger than the whole bound is not kept. Not
    thread-safe: its owner locks."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.bytes = 0
        self._items: collections.OrderedDict[bytes, tuple[V, int]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: bytes) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: bytes, value: V, size: int) -> bool:
        """Keep ``value`` (evicting the least recently used); False when it is larger than
        the whole bound (then nothing is evicted for it)."""
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        if size > self.bound:
            return False
        while self._items and self.bytes + size > self.bound:
            _, (_, freed) = self._items.popitem(last=False)
            self.bytes -= freed
        self._items[key] = (value, size)
        self.bytes += size
        return True

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0


# Digests of the grammars the offline path parsed (check_constraint without a deferral).
_checked: ByteLRU[bool] = ByteLRU(CHECKED_ENTRIES * 32)
_checked_lock = threading.Lock()


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


class GrammarState:
    """One request's position in its grammar: a matcher that has accepted the
    request's first ``accepted`` output tokens."""

    def __init__(self, compiled: "Future[Any]", kind: str | None = None, timeout: float | None = None) -> None:
        self.compiled = compiled
        self.kind = kind
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout if timeout is not None else float("inf")
        self.released = False      # its request ended: nobody needs the compile any more
        self.job: _Job | None = None  # the compile it waits for (a GrammarBackend's)
        self.agreed: int | None = None  # FAILED / COMPILING / READY as the TP ranks agreed (settle)
        self._matcher: Any = None
        self.accepted = 0
        self.rejected: int | None = None  # an output token the grammar refused (a bug if ever set)

    def local_code(self) -> int:
        """FAILED, COMPILING or READY on this rank, now (a compile past its deadline failed)."""
        c = self.compiled
        if c.done():
            return FAILED if c.cancelled() or c.exception() is not None else READY
        return FAILED if time.monotonic() > self.deadline else COMPILING

    def settle(self, code: int | None = None) -> None:
        """Fix what the scheduler acts on: ``code`` as the TP ranks agreed (default: this
        rank's). READY and FAILED are final."""
        if self.agreed in (None, COMPILING):
            self.agreed = self.local_code() if code is None else code

    def _code(self) -> int:
        return self.agreed if self.agreed is not None else self.local_code()

    @property
    def ready(self) -> bool:
        """Done waiting: compiled, failed, or past its deadline (see ``error``)."""
        return self._code() != COMPILING

    @property
    def error(self) -> str | None:
        """Why the request cannot run (None: it compiled, or is still compiling)."""
        if self._code() != FAILED:
            return None
        c = self.compiled
        if c.done() and not c.cancelled() and c.exception() is not None:
            message = _CPP_PREFIX.sub("", str(c.exception())).strip()
            return message if self.kind is None or message.startswith(f"{self.kind}:") else f"{self.kind}: {message}"
        if c.done() and not c.cancelled():
            return ("the output's grammar failed to compile, or missed its deadline "
                    f"({FLAG_TIMEOUT}), on another tensor-parallel rank")
        timeout = f"{self.timeout:g} s " if self.timeout is not None else ""
        return f"the output's grammar did not compile within its {timeout}deadline ({FLAG_TIMEOUT})"

    def release(self) -> None:
        """Its request ended: a compile only it waited for is stopped."""
        if not self.released and self.job is not None and not self.compiled.done() \
                and time.monotonic() > self.deadline:
            self.job.expired = True
        self.released = True

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr

            # Never blocks: every path admits a constrained request only once its grammar
            # is ready. A request that got here without it fails alone (the step's guard)
            # instead of freezing every other one behind a compile.
            if self._code() != READY or not self.compiled.done():
                raise RuntimeError("the request reached a draw before its grammar compiled")
            self._matcher = xgr.GrammarMatcher(self.compiled.result())
        return self._matcher

    def advance(self, output_ids: Sequence[int]) -> bool:
        """Accept the output tokens gained since the last call; True once the grammar
        has ended (its stop token accepted)."""
        m = self.matcher
        while self.accepted < len(output_ids) and self.rejected is None:
            token = output_ids[self.accepted]
            if m.is_terminated():
                break  # ended on a stop token the request went past (ignore_eos)
            if not m.accept_token(token):
                self.rejected = token
                break
            self.accepted += 1
        return bool(m.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int, output_ids: Sequence[int], path: Sequence[int]) -> None:
        """Row ``row`` of ``bitmask``: the tokens allowed after ``output_ids`` + ``path``
        (a draft-tree path is accepted, read and rolled back; a path the grammar
        refuses cannot be emitted, so its row keeps what the refused prefix allows)."""
        self.advance(output_ids)
        m = self.matcher
        taken = 0
        for token in path:
            if m.is_terminated() or not m.accept_token(token):
                break
            taken += 1
        if not m.is_terminated():
            m.fill_next_token_bitmask(bitmask, row)
        if taken:
            m.rollback(taken)
