"""One request's grammar: its matcher and the packed token masks it fills.

Split from ``grammar.py`` along the line between the *compiler*, shared by every request
of a scheduler (``grammar.py``: threads, a worker process, the cache of compiled
grammars), and what *one request* holds while it decodes: a ``GrammarState`` (the
compile it waits for, its deadline, the readiness the TP ranks agreed, and a matcher
that follows the request's output) and the int32 bitmask rows it fills
(``new_bitmask``, which the batch allocates without knowing about compilers).

The matcher follows the request's committed output lazily: before it fills a mask or
judges a stop it accepts whatever tokens the request gained since (a decoded token, a
speculative round's accepted tokens, the first token a prefill server drew across the
split). So no code path that appends output has to know about grammars. A speculative
draw view (the request plus a draft-tree path) gets its mask by accepting the path,
filling, and rolling the path back.

Masks are filled on the host into xgrammar's packed int32 bitmask (1 bit per token) and
go up with the rest of the sampler's inputs; the sampler unpacks them on the device.

Every name here is also importable from ``pdserve.scheduler.grammar``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Sequence

import torch

from pdserve.scheduler.grammar_text import _CPP_PREFIX, FLAG_TIMEOUT

if TYPE_CHECKING:
    from pdserve.scheduler.grammar import _Job

# A grammar's state as the scheduler acts on it. The order matters: TP ranks agree by
# taking the minimum, so a failure on any rank fails it everywhere, and it is ready only
# once it is ready on every rank.
FAILED, COMPILING, READY = 0, 1, 2


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32 packed token masks (xgrammar's layout), every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


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
