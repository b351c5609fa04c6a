"""One leg of an attempt (the request as one worker answered it) and what its outcome
means for the attempt: an answer, or a `Failure` that says whether another pair may be
tried and what the client gets if it is final.

Split from proxy.py, which pairs workers, sends the legs and retries: the verdicts here
are the failure rules of its module doc made code (a connection-level failure takes the
worker out of rotation, a 503 with Retry-After or "draining" is shed, a 4xx is the
answer, a 200 can still carry a server-side abort), the same for unary answers, a
prefill leg's streamed answer and decode's first event (streaming.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.router.errors import error_bytes
from pdserve.router.logprobs import results_by_index
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import Worker, WorkerRegistry, says_draining

# After decode has finished, how long the router keeps waiting for a prefill leg that has
# not answered yet before aborting it (decode only finishes after prefill's transfer, so
# this is normally immediate).
PREFILL_GRACE_S = 30.0


@dataclass
class Reply:
    """A complete (non-streaming) answer."""
    status: int
    content: bytes
    media_type: str = "application/json"
    headers: dict[str, str] | None = None


@dataclass
class Failure:
    """Why an attempt failed, and what the client gets if it is the final outcome."""
    cause: str
    message: str
    retryable: bool
    status: int
    worker: Worker | None = None
    content: bytes | None = None  # the worker's own body, passed through when final
    retry_after: str | None = None  # a shedding worker's Retry-After

    def reply(self) -> Reply:
        headers = {"retry-after": self.retry_after} if self.retry_after is not None else None
        if self.content is not None:
            return Reply(self.status, self.content, headers=headers)
        return Reply(self.status, error_bytes(self.message, self.status), headers=headers)


@dataclass
class Leg:
    """What one worker answered (or the error that kept it from answering)."""
    worker: Worker
    status: int | None = None
    content: bytes = b""
    error: BaseException | None = None
    retry_after: str | None = None


class LegJudge:
    """Classifies legs' outcomes; a worker that failed at the connection level is marked
    down, a draining one taken out of rotation, and every failure is counted."""

    def __init__(self, registry: WorkerRegistry, metrics: RouterMetrics) -> None:
        self.registry = registry
        self.metrics = metrics

    def transport_failure(self, worker: Worker, exc: BaseException) -> Failure:
        what = f"{worker.role} worker {worker.url}"
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            self.metrics.errors.labels("timeout").inc()
            return Failure("timeout", f"{what} timed out ({type(exc).__name__})", False, 504, worker)
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.registry.mark_down(worker, f"request failed: {reason}")
        self.metrics.errors.labels("connect_error").inc()
        return Failure("connect_error", f"{what} failed: {reason}", True, 502, worker)

    def status_failure(self, worker: Worker, status: int, content: bytes,
                        retry_after: str | None = None) -> Failure:
        what = f"{worker.role} worker {worker.url}"
        message = _error_message(content) or f"HTTP {status}"
        if status == 503 and (says_draining(content) or "draining" in message.lower()):
            # Shutting down gracefully: out of rotation (not a failure), ask another worker.
            self.registry.mark_draining(worker)
            return Failure("draining", f"{what} is draining", True, status, worker, content, retry_after)
        if status == 503 and retry_after is not None:
            # Its queue is full (--max-queued-requests): another worker may have room.
            self.metrics.errors.labels("shed").inc()
            return Failure("shed", f"{what} shed the request: {message}", True, status, worker, content,
                           retry_after)
        if status >= 500:
            self.metrics.errors.labels("worker_5xx").inc()
            return Failure("worker_5xx", f"{what}: {message}", True, status, worker, content)
        self.metrics.errors.labels("worker_4xx").inc()
        return Failure("worker_4xx", f"{what}: {message}", False, status, worker, content)

    def payload_failure(self, worker: Worker, route: str, payload: Any, content: bytes) -> Failure | None:
        """A 200 that still reports a server-side failure: an error object (an SSE error
        event) or a sample that ended with an abort (e.g. a failed KV transfer)."""
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            err = payload["error"]
            code = err.get("code")
            status = int(code) if isinstance(code, int) or (isinstance(code, str) and code.isdigit()) else 500
            if status < 400:
                status = 500
            return self.status_failure(worker, status, json.dumps(payload).encode())
        reason = _abort_reason(route, payload)
        if reason is not None:
            self.metrics.errors.labels("worker_5xx").inc()
            return Failure("worker_5xx", f"{worker.role} worker {worker.url}: {reason}", True, 200, worker, content)
        return None

    def check_unary(self, leg: Leg, route: str) -> tuple[Failure | None, Any]:
        if leg.error is not None:
            return self.transport_failure(leg.worker, leg.error), None
        assert leg.status is not None
        if leg.status >= 400:
            return self.status_failure(leg.worker, leg.status, leg.content, leg.retry_after), None
        try:
            payload = json.loads(leg.content)
        except ValueError:
            self.metrics.errors.labels("worker_5xx").inc()
            return Failure("worker_5xx", f"{leg.worker.role} worker {leg.worker.url}: answer is not JSON",
                           True, 502, leg.worker), None
        return self.payload_failure(leg.worker, route, payload, leg.content), payload

    def check_prefill_stream(self, leg: Leg, route: str) -> tuple[Failure | None, Any]:
        """Prefill's whole streamed answer (it answers once its transfer has succeeded)."""
        if leg.error is not None:
            return self.transport_failure(leg.worker, leg.error), None
        assert leg.status is not None
        if leg.status >= 400:
            return self.status_failure(leg.worker, leg.status, leg.content, leg.retry_after), None
        last: Any = None
        merged: dict[int, Any] = {}
        for line in leg.content.decode(errors="replace").splitlines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            try:
                payload = json.loads(line[5:])
            except ValueError:
                continue
            fail = self.payload_failure(leg.worker, route, payload, line[5:].strip().encode())
            if fail is not None:
                if fail.status == 200:  # an abort event: as an error for a stream's status line
                    fail.status, fail.content = 503, error_bytes(fail.message, 503)
                return fail, None
            last = payload
            merged.update(results_by_index(route, payload))
        if route == "/generate":
            return None, [merged[i] for i in sorted(merged)] if merged else last
        return None, {"choices": [merged[i] for i in sorted(merged)]} if merged else last


def _error_message(content: bytes) -> str | None:
    try:
        err = json.loads(content).get("error")
        return str(err.get("message")) if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        return None


def _abort_reason(route: str, payload: Any) -> str | None:
    """The message of a sample that ended with a server-side abort, if any."""
    if route == "/generate":
        for item in payload if isinstance(payload, list) else [payload]:
            fin = item.get("meta_info", {}).get("finish_reason") if isinstance(item, dict) else None
            if isinstance(fin, dict) and fin.get("type") == "abort":
                return str(fin.get("message") or "aborted")
        return None
    if isinstance(payload, dict):
        for choice in payload.get("choices") or ():
            if isinstance(choice, dict) and choice.get("finish_reason") == "abort":
                return "a sample was aborted by the server"
    return None
