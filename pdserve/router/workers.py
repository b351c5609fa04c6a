"""The workers behind the router and whether each is in rotation.

A worker is in rotation after a successful `GET /health` probe and out of it at
once when a probe fails or a request to it fails at the connection level; the next
successful probe puts it back. Probes run on a fixed cadence (not "sleep after the
probe"), each bounded by its own timeout, so a dead worker is out within
interval + timeout of dying even when it hangs instead of refusing connections.

A worker whose /health answers 503 with `{"status": "draining"}` (a server shutting
down gracefully) is out of rotation too, but that is not a failure: no warning, no
health-check failure counted, nor when it then stops answering at all (a drained
server exits); it comes back if it answers 200 again.

The set of workers changes at run time (POST / DELETE /workers, Kubernetes discovery):
`add` registers a worker (in rotation after its first successful probe), `remove`
drains it: out of rotation at once, removed (its connection pool closed, the policies
told to forget it) once the legs and aborts it has in flight are done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable, Iterable

import httpx

from pdserve.router.config import WorkerSpec

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05  # how often a worker being removed is checked for legs still in flight


class DuplicateWorker(ValueError):
    """The URL is already one of the router's workers."""


def says_draining(content: bytes) -> bool:
    """A body of the servers' graceful drain: a JSON object with status "draining"."""
    try:
        payload = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(payload, dict) and payload.get("status") == "draining"


class Worker:
    """One server as the router sees it. `in_flight` is the router's own count of legs
    sent and not yet answered (what the load-aware policies compare)."""

    def __init__(self, spec: WorkerSpec, client: httpx.AsyncClient, source: str = "flag") -> None:
        self.spec = spec
        self.source = source  # who added it: "flag", "api" or "discovery"
        # One connection pool per worker: httpcore's pool scans all of its connections
        # (quadratically) on every request, so one shared pool gets slower with every
        # worker and every concurrent request; per worker it stays short.
        self.client = client
        self.url = spec.url
        self.role = spec.role
        self.healthy = False
        self.in_flight = 0
        self.pending_aborts = 0     # background aborts still to reach it (they use its client)
        self.server_draining = False  # its /health said "draining": out of rotation, not failed
        self.removing = False       # DELETE /workers (or discovery): no new legs, then removed
        self.removed = False
        self.last_error: str | None = "not probed yet"
        self.changed_at = time.monotonic()
        self.added_at = time.time()
        self.state_since = time.time()  # wall clock of the last state change (GET /workers)
        self._down_at = float("-inf")  # a probe that started before this cannot re-admit
        self._drain_task: asyncio.Task | None = None

    @property
    def in_rotation(self) -> bool:
        return self.healthy and not self.removing

    @property
    def state(self) -> str:
        if self.removing:
            return "removing"
        if self.server_draining:
            return "draining"
        return "healthy" if self.healthy else "unhealthy"

    def describe(self) -> dict[str, object]:
        d: dict[str, object] = {"url": self.url, "role": self.role, "healthy": self.healthy,
                                "in_flight": self.in_flight, "last_error": self.last_error}
        if self.role == "prefill":
            d["bootstrap_port"] = self.spec.bootstrap_port
        return d

    def status(self) -> dict[str, Any]:
        """What GET /workers shows: role ("worker" for a colocated server, as the API
        names it), state and since when (unix seconds), in-flight legs, who added it."""
        d: dict[str, Any] = {"url": self.url, "role": "worker" if self.role == "plain" else self.role,
                             "state": self.state, "in_rotation": self.in_rotation, "healthy": self.healthy,
                             "in_flight": self.in_flight, "since": round(self.state_since, 3),
                             "added_at": round(self.added_at, 3), "source": self.source,
                             "last_error": self.last_error}
        if self.role == "prefill":
            d["bootstrap_port"] = self.spec.bootstrap_port
        return d

    def __repr__(self) -> str:
        return f"Worker({self.role} {self.url} {'up' if self.healthy else 'down'} in_flight={self.in_flight})"


class WorkerRegistry:
    def __init__(self, specs: Iterable[WorkerSpec], make_client: Callable[[], httpx.AsyncClient], *,
                 interval: float, timeout: float, on_change: Callable[[Worker], None] | None = None,
                 on_removed: Callable[[Worker], None] | None = None,
                 on_probe_failure: Callable[[Worker], None] | None = None) -> None:
        self.make_client = make_client
        self.workers = [Worker(s, make_client()) for s in specs]
        self.interval = interval
        self.timeout = timeout
        self.on_change = on_change
        self.on_removed = on_removed          # after a removed worker is gone (policies forget it)
        self.on_probe_failure = on_probe_failure  # a failed probe (not a draining answer)
        self._task: asyncio.Task | None = None

    def of_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def healthy(self, role: str) -> list[Worker]:
        """The workers of `role` in rotation (healthy, and not being removed)."""
        return [w for w in self.workers if w.role == role and w.in_rotation]

    def get(self, url: str) -> Worker | None:
        return next((w for w in self.workers if w.url == url), None)

    # ---- membership ------------------------------------------------------------------
    def add(self, spec: WorkerSpec, source: str) -> Worker:
        """Register a worker, out of rotation until a probe succeeds (the health loop
        probes it within one interval; the caller may probe it at once). A URL being
        removed with the same spec is kept instead (its removal is called off): a pod
        whose readiness flapped comes back without losing its in-flight legs."""
        old = self.get(spec.url)
        if old is not None:
            if old.removing and old.spec == spec:
                old.removing = False
                old.source = source
                old.state_since = time.time()
                logger.info("%s worker %s: removal called off, it stays", old.role, old.url)
                return old
            raise DuplicateWorker(f"{old.role} worker {old.url} is already registered ({old.state})")
        worker = Worker(spec, self.make_client(), source)
        self.workers.append(worker)
        logger.info("%s worker %s added (%s)", worker.role, worker.url, source)
        return worker

    def remove(self, worker: Worker) -> None:
        """Drain `worker`: no new legs from now on (it leaves rotation at once); it is
        removed once the legs and aborts it has in flight are done."""
        if worker.removing or worker.removed:
            return
        worker.removing = True
        worker.state_since = time.time()
        logger.info("%s worker %s is being removed: out of rotation, %d legs in flight", worker.role,
                    worker.url, worker.in_flight)
        if self.on_change is not None:
            self.on_change(worker)
        # Checked from a task of its own, never here: a leg picked just before this call
        # (its task created, not yet run) counts itself in flight by the time it runs.
        if worker._drain_task is not None:
            worker._drain_task.cancel()  # of a removal called off: one drain at a time
        worker._drain_task = asyncio.get_running_loop().create_task(self._finish_removal(worker))

    async def _finish_removal(self, worker: Worker) -> None:
        while True:
            await asyncio.sleep(DRAIN_POLL_S)
            if not worker.removing:
                return  # called off (re-added)
            if worker.in_flight == 0 and worker.pending_aborts == 0:
                break
        worker.removed = True
        worker.healthy = False
        self.workers.remove(worker)
        logger.info("%s worker %s removed", worker.role, worker.url)
        if self.on_removed is not None:
            self.on_removed(worker)
        await worker.client.aclose()

    # ---- state changes -------------------------------------------------------------
    def mark_down(self, worker: Worker, reason: str) -> None:
        """A request failed at the connection level: out of rotation now, back after a
        probe that starts from now on succeeds."""
        worker._down_at = time.monotonic()
        self._set(worker, False, reason)

    def mark_draining(self, worker: Worker) -> None:
        """The worker said it is draining (its /health, or its answer to a request): out of
        rotation, and not a failure; a probe answering 200 puts it back."""
        if worker.removed:
            return
        if not worker.server_draining:
            worker.server_draining = True
            worker.state_since = time.time()
            logger.info("%s worker %s is draining: out of rotation", worker.role, worker.url)
        worker.last_error = None
        if worker.healthy:
            worker.healthy = False
            worker.changed_at = time.monotonic()
            if self.on_change is not None:
                self.on_change(worker)

    def _set(self, worker: Worker, healthy: bool, reason: str | None) -> None:
        if worker.removed:
            return  # a probe that was under way when the worker went
        worker.last_error = reason
        if healthy and worker.server_draining:
            worker.server_draining = False
            worker.state_since = time.time()
        if worker.healthy != healthy:
            worker.healthy = healthy
            worker.changed_at = time.monotonic()
            worker.state_since = time.time()
            if healthy:
                logger.info("%s worker %s is in rotation", worker.role, worker.url)  # normal (startup)
            elif not worker.removing:
                logger.warning("%s worker %s is out of rotation: %s", worker.role, worker.url, reason)
            if self.on_change is not None:
                self.on_change(worker)

    # ---- probes --------------------------------------------------------------------
    async def probe(self, worker: Worker) -> bool:
        started = time.monotonic()
        draining = False
        try:
            r = await worker.client.get(worker.url + "/health", timeout=self.timeout)
            ok, reason = r.status_code == 200, f"GET /health answered {r.status_code}"
            draining = r.status_code == 503 and says_draining(r.content)
        except httpx.HTTPError as exc:
            ok, reason = False, f"GET /health failed: {type(exc).__name__}: {exc}"
        except RuntimeError:
            return False  # its client was closed: the worker was removed during the probe
        if ok:
            if started >= worker._down_at:
                self._set(worker, True, None)
        elif draining:
            self.mark_draining(worker)
        elif worker.server_draining:
            # A drained server exits: its going away ends the drain, it is no failure. It
            # stays out of rotation (state "draining") until it answers 200 again.
            worker.last_error = f"after draining: {reason}"
        else:
            if self.on_probe_failure is not None and not worker.removed:
                self.on_probe_failure(worker)
            self._set(worker, False, reason)
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in list(self.workers)))

    async def run(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await self.probe_all()
            except Exception:  # never let the health loop die silently
                logger.exception("health check round failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - t0)))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for w in self.workers:
            if w._drain_task is not None:
                w._drain_task.cancel()
        await asyncio.gather(*(w.client.aclose() for w in self.workers))
