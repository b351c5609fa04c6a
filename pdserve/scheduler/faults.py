"""Fault isolation: an error while handling some requests ends those requests (each
with the error, as a server error, so a router may retry them elsewhere), never the
scheduler. Every phase of a step that handles particular requests runs inside
``Scheduler.guarded(...)``; the rank loop's ``fail_all`` is the last resort for an
error no guard caught."""

from __future__ import annotations

import logging
from typing import Callable

from pdserve.scheduler.batch import StepOutput
from pdserve.scheduler.req import FinishKind, FinishReason, Req

logger = logging.getLogger(__name__)


def internal_error(message: str) -> FinishReason:
    return FinishReason(FinishKind.ABORT, message=f"internal error: {message}", server_error=True)


class Guard:
    """``with Guard(fail, reqs, out, what):`` -- an exception inside fails ``reqs`` (a
    callable, read at that moment) through ``fail`` instead of the step."""

    def __init__(self, fail: Callable[[Req, str], list[Req]], reqs: Callable[[], list[Req]], out: StepOutput,
                 what: str) -> None:
        self.fail, self.reqs, self.out, self.what = fail, reqs, out, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        reqs = list({id(r): r for r in self.reqs()}.values())
        logger.error("%s failed for request(s) %s", self.what, sorted({r.rid for r in reqs}),
                     exc_info=(kind, exc, tb))  # type: ignore[arg-type]
        for req in reqs:
            self.out.finished += self.fail(req, f"{self.what}: {exc}")
        return True


def end_despite(req: Req, reason: FinishReason, finish: Callable[[Req, FinishReason], list[Req]]) -> list[Req]:
    """End ``req`` after an internal error, giving back what it holds as far as that
    still works: when its KV bookkeeping is what broke, leak it rather than the server."""
    try:
        return finish(req, reason)
    except Exception:
        logger.exception("request %s: releasing after an internal error failed", req.rid)
        done = [req] + req.pending_forks
        for r in done:
            r.finish, r.row = reason, None
        req.pending_forks = []
        return done
