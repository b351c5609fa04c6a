"""Fault isolation: an error while handling some requests ends those requests (each
with the error, as a server error, so a router may retry them elsewhere), never the
scheduler. Every phase of a step that handles particular requests runs inside
``guarded(...)``; the rank loop's ``fail_all`` is the last resort for an error no
guard caught."""

from __future__ import annotations

import abc
import logging
from typing import Callable

from pdserve.scheduler.batch import StepOutput
from pdserve.scheduler.req import FinishKind, FinishReason, Req

logger = logging.getLogger(__name__)


class Guard:
    def __init__(self, sched: "FaultIsolation", reqs: Callable[[], list[Req]], out: StepOutput, what: str) -> None:
        self.sched, self.reqs, self.out, self.what = sched, reqs, out, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        reqs = list({id(r): r for r in self.reqs()}.values())
        logger.error("%s failed for request(s) %s", self.what, sorted({r.rid for r in reqs}),
                     exc_info=(kind, exc, tb))  # type: ignore[arg-type]
        for req in reqs:
            self.out.finished += self.sched.fail_request(req, f"{self.what}: {exc}")
        return True


class FaultIsolation(abc.ABC):
    """The scheduler's part that ends requests after internal errors (mixed into it:
    it needs its queues and ``finish``; PD schedulers extend ``fail_request`` and
    ``live_requests`` with their handoffs)."""
    waiting: list[Req]
    running: list[Req]
    chunked: Req | None

    @abc.abstractmethod
    def finish(self, req: Req, reason: FinishReason) -> list[Req]:
        """End ``req`` (and its never-forked samples) and give back what it holds."""

    def fail_request(self, req: Req, message: str) -> list[Req]:
        """End one request after an internal error while handling it (wherever it is),
        giving back what it holds as far as that still works: the step goes on for
        every other request."""
        if req.finish is not None:
            return []
        reason = FinishReason(FinishKind.ABORT, message=f"internal error: {message}", server_error=True)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req is self.chunked:
            self.chunked = None
        try:
            return self.finish(req, reason)
        except Exception:  # its KV bookkeeping is what broke: leak it rather than the server
            logger.exception("request %s: releasing after an internal error failed", req.rid)
            done = [req] + req.pending_forks
            for r in done:
                r.finish, r.row = reason, None
            req.pending_forks = []
            return done

    def guarded(self, reqs: list[Req] | Callable[[], list[Req]], out: StepOutput, what: str) -> Guard:
        """``with self.guarded(reqs, out, what):`` -- an exception inside fails ``reqs``
        (each with the error; a callable is read at that moment) instead of the step."""
        return Guard(self, reqs if callable(reqs) else (lambda: reqs), out, what)  # type: ignore[arg-type]

    def live_requests(self) -> list[Req]:
        """Every request the scheduler holds that has not finished."""
        return self.waiting + self.running + ([self.chunked] if self.chunked is not None else [])

    def fail_all(self, message: str) -> list[Req]:
        """The last resort after a step failed outside any request's guard: every live
        request ends with the error (each gets its one final outcome), the server goes on."""
        out: list[Req] = []
        for req in self.live_requests():
            out += self.fail_request(req, message)
        return out
