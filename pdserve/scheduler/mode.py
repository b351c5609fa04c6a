"""What a serving mode adds to the one scheduler: hooks at fixed points of its step.

A colocated server uses this class as it is (every hook does nothing more). A prefill
or decode server composes its side of the disaggregation protocol into the scheduler
(``pdserve.disagg.prefill_side`` / ``decode_side``): requests it holds outside the
scheduler's queues (a room being bootstrapped, a transfer in flight), what happens
outside the model between steps, what the step's results are sent on to. The
scheduler calls the hooks; no mode overrides the step itself.

Modes are built by name through ``SCHEDULER_MODES`` (lazily imported, so this package
imports nothing of ``pdserve.disagg``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from pdserve.lazy import load_target
from pdserve.scheduler.batch import ScheduledBatch, StepOutput
from pdserve.scheduler.queues import RequestQueues
from pdserve.scheduler.req import FinishReason, Req

if TYPE_CHECKING:
    from pdserve.scheduler.scheduler import Scheduler


class Mode:
    """The colocated mode; the base of the disaggregated ones."""
    publishes_tokens = True  # False: drawn tokens are handed on, not published (a prefill server)
    # A PD side's host copies of its transfer buffers (--disaggregation-kv-staging host);
    # None: no copies (colocated, or the engine registers the KV buffers themselves).
    staging: object | None = None

    def __init__(self, queues: RequestQueues) -> None:
        self.queues = queues

    def add(self, req: Req) -> None:
        """A new request (its grammar already compiling): queue it."""
        self.queues.waiting.append(req)

    def abort(self, rid: str, reason: FinishReason) -> list[Req]:
        """End every sample of ``rid``; returns them."""
        return self.queues.abort(rid, reason)

    @property
    def has_work(self) -> bool:
        """Requests this mode holds outside the scheduler's queues."""
        return False

    def poll_external(self, out: StepOutput) -> None:
        """Take in what changed outside the model since the last step."""

    def may_decode(self) -> bool:
        """Whether this step may run the decode strategy."""
        return True

    def commit(self, batch: ScheduledBatch | None, out: StepOutput) -> None:
        """Act on the step's results."""

    def fail_request(self, req: Req, message: str) -> list[Req] | None:
        """Undo what this mode holds for ``req`` after an internal error; a list: it ended
        the request itself; None: the scheduler ends it as usual."""
        return None

    def live_requests(self) -> list[Req]:
        """Live requests this mode holds outside the scheduler's queues."""
        return []

    def state(self, base: dict[str, Any]) -> dict[str, Any]:
        return base

    def close(self) -> None:
        """Stop what this mode runs (threads, sockets, transfer engines)."""


# name -> "module:function" building a scheduler of that mode, called as
# ``build(args, runner, decode_text, tp)``; "null" is the colocated scheduler.
SCHEDULER_MODES: dict[str, str] = {
    "prefill": "pdserve.disagg.build:build_prefill_scheduler",
    "decode": "pdserve.disagg.build:build_decode_scheduler",
}


def mode_builder(name: str) -> Callable[..., "Scheduler"]:
    """The builder of the scheduler of mode ``name`` (imported now)."""
    if name not in SCHEDULER_MODES:
        raise ValueError(f"--disaggregation-mode: {name!r} is not one of {', '.join(['null', *SCHEDULER_MODES])}")
    return load_target(SCHEDULER_MODES[name])  # type: ignore[no-any-return]
