"""The workers behind the router and whether each is in rotation.

A worker is in rotation after a successful `GET /health` probe and out of it at
once when a probe fails or a request to it fails at the connection level; the next
successful probe puts it back. Probes run on a fixed cadence (not "sleep after the
probe"), each bounded by its own timeout, so a dead worker is out within
interval + timeout of dying even when it hangs instead of refusing connections.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable

import httpx

from pdserve.router.config import WorkerSpec

logger = logging.getLogger(__name__)


class Worker:
    """One server as the router sees it. `in_flight` is the router's own count of legs
    sent and not yet answered (what the load-aware policies compare)."""

    def __init__(self, spec: WorkerSpec, client: httpx.AsyncClient) -> None:
        self.spec = spec
        # One connection pool per worker: httpcore's pool scans all of its connections
        # (quadratically) on every request, so one shared pool gets slower with every
        # worker and every concurrent request; per worker it stays short.
        self.client = client
        self.url = spec.url
        self.role = spec.role
        self.healthy = False
        self.in_flight = 0
        self.last_error: str | None = "not probed yet"
        self.changed_at = time.monotonic()
        self._down_at = float("-inf")  # a probe that started before this cannot re-admit

    def describe(self) -> dict[str, object]:
        d: dict[str, object] = {"url": self.url, "role": self.role, "healthy": self.healthy,
                                "in_flight": self.in_flight, "last_error": self.last_error}
        if self.role == "prefill":
            d["bootstrap_port"] = self.spec.bootstrap_port
        return d

    def __repr__(self) -> str:
        return f"Worker({self.role} {self.url} {'up' if self.healthy else 'down'} in_flight={self.in_flight})"


class WorkerRegistry:
    def __init__(self, specs: Iterable[WorkerSpec], make_client: Callable[[], httpx.AsyncClient], *,
                 interval: float, timeout: float, on_change: Callable[[Worker], None] | None = None) -> None:
        self.workers = [Worker(s, make_client()) for s in specs]
        self.interval = interval
        self.timeout = timeout
        self.on_change = on_change
        self._task: asyncio.Task | None = None

    def of_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.healthy]

    # ---- state changes -------------------------------------------------------------
    def mark_down(self, worker: Worker, reason: str) -> None:
        """A request failed at the connection level: out of rotation now, back after a
        probe that starts from now on succeeds."""
        worker._down_at = time.monotonic()
        self._set(worker, False, reason)

    def _set(self, worker: Worker, healthy: bool, reason: str | None) -> None:
        worker.last_error = reason
        if worker.healthy != healthy:
            worker.healthy = healthy
            worker.changed_at = time.monotonic()
            if healthy:
                logger.info("%s worker %s is in rotation", worker.role, worker.url)  # normal (startup)
            else:
                logger.warning("%s worker %s is out of rotation: %s", worker.role, worker.url, reason)
            if self.on_change is not None:
                self.on_change(worker)

    # ---- probes --------------------------------------------------------------------
    async def probe(self, worker: Worker) -> bool:
        started = time.monotonic()
        try:
            r = await worker.client.get(worker.url + "/health", timeout=self.timeout)
            ok, reason = r.status_code == 200, f"GET /health answered {r.status_code}"
        except httpx.HTTPError as exc:
            ok, reason = False, f"GET /health failed: {type(exc).__name__}: {exc}"
        if ok:
            if started >= worker._down_at:
                self._set(worker, True, None)
        else:
            self._set(worker, False, reason)
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self.workers))

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
        await asyncio.gather(*(w.client.aclose() for w in self.workers))
