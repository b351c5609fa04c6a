"""The HTTP process's grammar work (issue 39): a request's json_schema / regex / ebnf is
parsed on this process's own grammar thread, never on the threads that tokenize
prompts (``TokenizerManager.off_loop``).

While the routes build a request on a tokenizing thread, ``check_constraint`` runs under
a ``Deferral``: it checks the size and depth limits at once (a 400 naming the flag,
before anything parses) and answers from the cache, leaving unknown grammars pending.
The manager then awaits their parse here, at most --grammar-compile-timeout; an invalid
or slow grammar makes it build the request again on the tokenizing thread, where
``check_constraint`` now raises the error in the caller's own words (a response_format
schema's error names ``response_format.json_schema``). A parse nobody waits for any more
(its requests timed out or went away) is dropped before it starts; one under way is
bounded by the limits. Outcomes are cached by digest, bounded in bytes
(--grammar-cache-bytes), and the parsed grammar (EBNF) replaces the client's text in the
message to the scheduler (``to_scheduler``), which so never parses a schema again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from pdserve.scheduler.grammar import (ENTRY_OVERHEAD, FLAG_TIMEOUT, ByteLRU, Deferral, GrammarLimits,
                                       canonical_ebnf, deferring, digest)
from pdserve.scheduler.messages import NewRequest

T = TypeVar("T")
# One thread: grammar work takes at most one core of the HTTP process, whatever clients send.
GRAMMAR_THREADS = 1


@dataclasses.dataclass
class _Parse:
    future: "Future[tuple[bool, str]]"
    waiters: int = 0


class GrammarChecker:
    def __init__(self, limits: GrammarLimits = GrammarLimits()) -> None:
        self.limits = limits
        self.executor = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="pdserve-grammar")
        self._lock = threading.Lock()
        # digest -> (valid, EBNF if valid else the error message)
        self._cache: ByteLRU[tuple[bool, str]] = ByteLRU(limits.cache_bytes)
        self._parsing: dict[bytes, _Parse] = {}
        self.parsed = 0     # grammars parsed (not answered from the cache)
        self.timed_out = 0  # waits that ran past the deadline

    # ---- on a tokenizing thread ---------------------------------------------------------
    def build(self, fn: Callable[..., T], *args: Any, failures: dict[bytes, str] | None = None
              ) -> tuple[T, dict[bytes, tuple[str, str]]]:
        """``fn(*args)`` with grammar checks deferred: its result and the grammars still to
        parse (digest -> (kind, text)). ``failures`` (digest -> message) are raised as the
        cache's errors are, by the ``check_constraint`` that meets them."""
        def lookup(key: bytes) -> str | None:
            if failures is not None and key in failures:
                return failures[key]
            with self._lock:
                known = self._cache.get(key)
            return None if known is None else ("" if known[0] else known[1])

        with deferring(Deferral(self.limits, lookup)) as deferral:
            result = fn(*args)
        return result, deferral.pending

    # ---- on the event loop --------------------------------------------------------------
    async def resolve(self, pending: dict[bytes, tuple[str, str]]) -> dict[bytes, str]:
        """Parse ``pending`` on the grammar thread, waiting at most the deadline; returns
        the failures (digest -> message naming the field; empty: all valid)."""
        futures = {key: self._join(key, kind, text) for key, (kind, text) in pending.items()}
        waits = {key: asyncio.wrap_future(f) for key, f in futures.items()}
        try:
            done, _ = await asyncio.wait(waits.values(), timeout=self.limits.timeout)
        finally:
            for key in futures:
                self._leave(key)
        failures = {}
        for key, wait in waits.items():
            kind = pending[key][0]
            if wait not in done:
                self.timed_out += 1
                failures[key] = (f"{kind}: parsing it took longer than its {self.limits.timeout:g} s deadline "
                                 f"({FLAG_TIMEOUT})")
                continue
            valid, text = wait.result()
            if not valid:
                failures[key] = text
        return failures

    def to_scheduler(self, msg: NewRequest) -> NewRequest:
        """``msg`` with its constraint as the parsed grammar's EBNF, when the cache has it
        (otherwise as the client sent it: the scheduler then parses it itself)."""
        constraint = msg.params.constraint
        if constraint is None:
            return msg
        with self._lock:
            known = self._cache.get(digest(*constraint))
        if known is None or not known[0]:
            return msg
        params = dataclasses.replace(msg.params, json_schema=None, regex=None, ebnf=known[1])
        return dataclasses.replace(msg, params=params)

    # ---- the grammar thread ---------------------------------------------------------------
    def _join(self, key: bytes, kind: str, text: str) -> "Future[tuple[bool, str]]":
        with self._lock:
            known = self._cache.get(key)
            if known is not None:
                done: Future[tuple[bool, str]] = Future()
                done.set_result(known)
                return done
            parse = self._parsing.get(key)
            if parse is None:
                parse = self._parsing[key] = _Parse(self.executor.submit(self._parse, key, kind, text))
            parse.waiters += 1
            return parse.future

    def _leave(self, key: bytes) -> None:
        with self._lock:
            parse = self._parsing.get(key)
            if parse is None:
                return
            parse.waiters -= 1
            if parse.waiters == 0 and parse.future.cancel():  # (only one that has not started)
                del self._parsing[key]

    def _parse(self, key: bytes, kind: str, text: str) -> tuple[bool, str]:
        try:
            outcome = (True, canonical_ebnf(kind, text))
        except ValueError as exc:
            outcome = (False, str(exc))
        except Exception as exc:  # noqa: BLE001 - whatever the parser raised, the request gets a 400
            outcome = (False, f"{kind}: could not be parsed: {exc}")
        with self._lock:
            self.parsed += 1
            self._cache.put(key, outcome, len(outcome[1]) + ENTRY_OVERHEAD)
            self._parsing.pop(key, None)
        return outcome

    # ---- inspection and teardown ----------------------------------------------------------
    def flush(self) -> None:
        with self._lock:
            self._cache.clear()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"cache_bytes": self._cache.bytes, "cache_entries": len(self._cache),
                    "cache_limit_bytes": self._cache.bound, "parsing": len(self._parsing),
                    "parsed": self.parsed, "timed_out": self.timed_out}

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
