"""Constrained decoding: grammars compiled off the step, one matcher per request.

A request with ``json_schema``, ``regex`` or ``ebnf`` gets a ``GrammarState``
when it reaches a scheduler. Its grammar compiles on the ``GrammarBackend``'s own
thread (a cache keyed by the grammar text, so a repeated schema compiles once);
admission skips the request until the compile is done, so a slow grammar never
holds back the batch.

The matcher follows the request's committed output lazily: before it fills a
mask or judges a stop it accepts whatever tokens the request gained since (a
decoded token, a speculative round's accepted tokens, the first token a prefill
server drew across the split). So no code path that appends output has to know
about grammars. A speculative draw view (the request plus a draft-tree path)
gets its mask by accepting the path, filling, and rolling the path back.

Masks are filled on the host into xgrammar's packed int32 bitmask (1 bit per
token) and go up with the rest of the sampler's inputs; the sampler unpacks
them on the device.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import torch

from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CACHE_ENTRIES = 256  # compiled grammars kept (the LRU's size)
# xgrammar's messages start with "[time] /path/file.cc:line: "; users need the rest.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'        # (EBNF text, as xgrammar prints it)
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


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


def check_constraint(params: SamplingParams) -> None:
    """Raise ValueError naming the field with the grammar compiler's message when the
    request's schema / regex / grammar is invalid (the HTTP layer makes it a 400)."""
    if params.constraint is not None:
        _check(*params.constraint)


@functools.lru_cache(maxsize=CACHE_ENTRIES)
def _check(kind: str, text: str) -> None:
    """Parse once per distinct grammar (clients resend the same schema; an invalid one
    raises, and exceptions are not cached)."""
    if kind == "json_schema":
        try:
            json.loads(text)
        except ValueError as exc:
            raise ValueError(f"json_schema: not valid JSON: {exc}") from None
    try:
        _parse(kind, text)
    except (RuntimeError, ValueError) as exc:
        message = _CPP_PREFIX.sub("", str(exc)).strip().splitlines()[0]
        raise ValueError(f"{kind}: invalid {kind.replace('_', ' ')}: {message}") from None


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32 packed token masks (xgrammar's layout), every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class GrammarBackend:
    """A scheduler's grammar compiler: the tokenizer's vocabulary as xgrammar sees it,
    a compile thread, and the compiled grammars of recent requests."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self._compiler: Any = None  # built on the compile thread at first use (the vocabulary scan)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()

    def compile(self, kind: str, text: str) -> "Future[Any]":
        key = (kind, text)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, kind, text)
            self._cache[key] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def _compile(self, kind: str, text: str) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler.compile_grammar(_parse(kind, text))

    def state(self, params: SamplingParams) -> "GrammarState | None":
        constraint = params.constraint
        return GrammarState(self.compile(*constraint)) if constraint is not None else None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's position in its grammar: a matcher that has accepted the
    request's first ``accepted`` output tokens."""

    def __init__(self, compiled: "Future[Any]") -> None:
        self.compiled = compiled
        self._matcher: Any = None
        self.accepted = 0
        self.rejected: int | None = None  # an output token the grammar refused (a bug if ever set)

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    @property
    def error(self) -> str | None:
        """Why the grammar did not compile (None: it did, or is still compiling)."""
        if not self.compiled.done() or self.compiled.exception() is None:
            return None
        return _CPP_PREFIX.sub("", str(self.compiled.exception())).strip()

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr

            # (Blocks only where a request reached a draw without admission: a decode
            # server's first step after a transfer that beat the compile.)
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
