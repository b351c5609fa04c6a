"""The workers behind the router and whether each is in rotation.

A worker is in rotation after a successful `GET /health` probe and out of it at
once when a probe fails or a request to it fails at the connection level; the next
successful probe puts it back. Each worker has a probe loop of its own on a fixed
cadence (not "sleep after the probe"), and each probe has one deadline for the whole
exchange (connect, headers, body: --health-check-timeout), not a timeout per read, and
reads at most MAX_HEALTH_BODY bytes of the answer. So a dead worker is out within
interval + timeout of dying even when it hangs instead of refusing connections, and a
worker that answers slowly, byte by byte, or without end delays nobody's probes but its
own and costs the router a bounded amount of memory.

A probe that finds the router itself (its /health carries the router's instance id,
ROUTER_ID_HEADER) never puts the worker in rotation: requests would loop.

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
MAX_HEALTH_BODY = 64 * 1024  # a /health answer is a few hundred bytes; beyond this the probe fails
ROUTER_ID_HEADER = "x-pdserve-router-id"  # on the router's own /health: its instance id
MAX_REASON_CHARS = 300  # of a failure's text kept in last_error and the logs


class DuplicateWorker(ValueError):
    """The URL is already one of the router's workers."""


class RefusedWorker(ValueError):
    """A worker the router will not register: its own address."""


class HealthBodyTooLarge(Exception):
    """A /health answer longer than MAX_HEALTH_BODY."""


def _short(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."


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
        self._probe_task: asyncio.Task | None = None  # its own health loop (WorkerRegistry.start)
        self.is_router = False      # its /health answered with this router's own id

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
                 on_probe_failure: Callable[[Worker], None] | None = None, router_id: str | None = None) -> None:
        self.make_client = make_client
        self.workers = [Worker(s, make_client()) for s in specs]
        self.interval = interval
        self.timeout = timeout
        self.on_change = on_change
        self.on_removed = on_removed          # after a removed worker is gone (policies forget it)
        self.on_probe_failure = on_probe_failure  # a failed probe (not a draining answer)
        self.router_id = router_id            # what our own /health says in ROUTER_ID_HEADER
        self._started = False
        # The router is shutting down (SIGTERM, Ctrl-C): its workers going out of rotation
        # then (pdserve up stops the servers after it) is expected, logged at debug only.
        self.shutting_down = False
        self._closing: set[asyncio.Task] = set()  # clients of discarded workers being closed

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
        if self._started:
            self._watch(worker)
        logger.info("%s worker %s added (%s)", worker.role, worker.url, source)
        return worker

    def discard(self, worker: Worker) -> None:
        """Undo an `add` that failed (its first probe raised, it is the router itself): the
        worker goes at once, as if it had never been registered. Nothing can be in flight
        on it: it was never in rotation."""
        if worker.removed:
            return
        worker.removed = True
        worker.healthy = False
        if worker in self.workers:
            self.workers.remove(worker)
        for task in (worker._probe_task, worker._drain_task):
            if task is not None:
                task.cancel()
        if self.on_removed is not None:
            self.on_removed(worker)
        closing = asyncio.get_running_loop().create_task(worker.client.aclose())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        logger.info("%s worker %s not added", worker.role, worker.url)

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
        if worker._probe_task is not None:
            worker._probe_task.cancel()
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
            logger.log(logging.DEBUG if self.shutting_down else logging.INFO, "%s worker %s is draining: out of "
                       "rotation", worker.role, worker.url)
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
                logger.log(logging.DEBUG if self.shutting_down else logging.WARNING,
                           "%s worker %s is out of rotation: %s", worker.role, worker.url, reason)
            if self.on_change is not None:
                self.on_change(worker)

    # ---- probes --------------------------------------------------------------------
    async def _get_health(self, worker: Worker) -> tuple[int, bytes, str | None]:
        """GET /health: (status, body, the router id header). The body is read raw (no
        decompression: a small compressed body could inflate without bound) and at most
        MAX_HEALTH_BODY bytes of it (HealthBodyTooLarge beyond)."""
        async with worker.client.stream("GET", worker.url + "/health", headers={"accept-encoding": "identity"},
                                        timeout=self.timeout) as r:
            length = r.headers.get("content-length", "")
            if length.isdigit() and int(length) > MAX_HEALTH_BODY:
                raise HealthBodyTooLarge(f"announces {int(length)} bytes")
            body = bytearray()
            async for chunk in r.aiter_raw():
                body += chunk
                if len(body) > MAX_HEALTH_BODY:
                    raise HealthBodyTooLarge(f"more than {MAX_HEALTH_BODY} bytes")
            return r.status_code, bytes(body), r.headers.get(ROUTER_ID_HEADER)

    async def probe(self, worker: Worker) -> bool:
        """One health probe of `worker`, within --health-check-timeout in all; its verdict
        applied. Never raises (but CancelledError): whatever goes wrong is a failed probe."""
        started = time.monotonic()
        status: int | None = None
        content: bytes = b""
        router_id: str | None = None
        try:
            # httpx's timeout is per read (a server sending a byte every half second never
            # trips it): the deadline is for the whole exchange.
            status, content, router_id = await asyncio.wait_for(self._get_health(worker), self.timeout)
            reason = f"GET /health answered {status}"
        except asyncio.TimeoutError:
            reason = f"GET /health failed: no complete answer within {self.timeout:g} s (--health-check-timeout)"
        except HealthBodyTooLarge as exc:
            reason = f"GET /health failed: answer too large ({exc}; the limit is {MAX_HEALTH_BODY} bytes)"
        except Exception as exc:  # httpx's errors; a closed client (removed meanwhile); anything odd
            if worker.removed or worker.client.is_closed:
                return False
            reason = f"GET /health failed: {type(exc).__name__}: {exc}"
        ok = status == 200
        draining = status == 503 and says_draining(content)
        if self.router_id is not None and router_id == self.router_id:
            # Our own /health: whatever it says, sending this worker requests would loop.
            worker.is_router = True
            self._set(worker, False, "this is the router itself (its /health carries the router's own id)")
            return False
        reason = _short(reason)
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
        """One probe of every worker, at once (at startup); each is bounded by its own deadline."""
        await asyncio.gather(*(self.probe(w) for w in list(self.workers)))

    async def _probe_loop(self, worker: Worker) -> None:
        """`worker`'s own health loop: a probe every interval (the first one interval from
        now: whoever registers a worker probes it at once), until it is removed."""
        next_at = time.monotonic() + self.interval
        logged = False
        while not worker.removed:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            # A fixed cadence, but a probe that took longer than the interval is not
            # followed by a burst of catching-up probes.
            next_at = max(next_at + self.interval, time.monotonic())
            try:
                await self.probe(worker)
            except Exception:  # a bug (probe never raises): say so once, keep probing
                if not logged:
                    logger.exception("health probe of %s failed", worker.url)
                    logged = True

    def _watch(self, worker: Worker) -> None:
        worker._probe_task = asyncio.get_running_loop().create_task(self._probe_loop(worker))

    def start(self) -> None:
        self._started = True
        for w in self.workers:
            if w._probe_task is None:
                self._watch(w)

    async def close(self) -> None:
        self._started = False
        tasks = [t for w in self.workers for t in (w._probe_task, w._drain_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(w.client.aclose() for w in self.workers), *self._closing, return_exceptions=True)
