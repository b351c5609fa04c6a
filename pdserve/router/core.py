"""What one router owns, apart from its HTTP routes: the worker registry and its health
loop, the proxy with one policy per role, the pod watcher, and the one path by which
workers are added and removed (the HTTP API and discovery both take it).

Split from app.py, which maps HTTP routes onto this: nothing here knows about requests
or responses, so discovery (discovery.py) drives the same object the routes do.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import TYPE_CHECKING, Any, Callable

import httpx

from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import make_policy
from pdserve.router.proxy import Proxy
from pdserve.router.urls import is_own_address
from pdserve.router.workers import RefusedWorker, Worker, WorkerRegistry

if TYPE_CHECKING:
    from pdserve.router.discovery import PodDiscovery

INFO_TIMEOUT_S = 5.0  # a worker's answer to the router's own queries (its info, a cache flush)


class Router:
    """Everything one router app owns (no module-level state)."""

    def __init__(self, cfg: RouterConfig, transport: httpx.AsyncBaseTransport | None,
                 randbits: Callable[[int], int], discovery: "PodDiscovery | None" = None) -> None:
        self.cfg = cfg
        self.metrics = RouterMetrics()
        # On our own /health: a probe that reads it back has found the router itself.
        self.instance_id = secrets.token_hex(16)
        self.worker_headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.admin_headers = {"authorization": f"Bearer {cfg.admin_api_key}"} if cfg.admin_api_key \
            else self.worker_headers

        def make_client() -> httpx.AsyncClient:
            # keepalive_expiry below the servers' (uvicorn's) 5 s keep-alive: the router never
            # reuses a connection the worker may be closing, which would look like a dead worker.
            return httpx.AsyncClient(
                transport=transport, timeout=httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0))
        self.registry = WorkerRegistry(cfg.all_workers, make_client, interval=cfg.health_check_interval,
                                       timeout=cfg.health_check_timeout, on_removed=self._forget_worker,
                                       on_probe_failure=lambda w: self.metrics.health_check_failures.labels(
                                           w.role, w.url).inc(), router_id=self.instance_id)
        policy_args = dict(threshold=cfg.cache_threshold, balance_abs_threshold=cfg.balance_abs_threshold,
                           max_tree_size=cfg.max_tree_size)
        pd = cfg.pd_disaggregation
        self.proxy = Proxy(self.registry, self.metrics, pd=pd,
                           prefill_policy=make_policy(cfg.prefill_policy, **policy_args) if pd else None,
                           decode_policy=make_policy(cfg.decode_policy if pd else cfg.policy, **policy_args),
                           retries=cfg.retries, headers=self.worker_headers, admin_headers=self.admin_headers,
                           randbits=randbits)
        self.roles = ("prefill", "decode") if pd else ("plain",)
        self.discovery = discovery

    async def start(self) -> None:
        await self.registry.probe_all()  # /health is right from the first request on
        self.registry.start()
        if self.discovery is not None:
            self.discovery.start(self, asyncio.get_running_loop())

    async def close(self) -> None:
        if self.discovery is not None:
            self.discovery.stop()
        await self.proxy.close()
        await self.registry.close()

    # ---- the one add / remove path (HTTP API and discovery) ------------------------------
    async def add_worker(self, spec: WorkerSpec, source: str) -> Worker:
        """Register `spec` and probe it at once: a healthy worker is in rotation when this
        returns (else the health loop keeps probing it every interval). Raises
        DuplicateWorker for a URL already registered, RefusedWorker for the router's own
        address (by its spelling, or because it answers with the router's id). An add
        that fails leaves nothing registered."""
        cfg = self.cfg
        if is_own_address(spec.url, cfg.host, cfg.port):
            raise RefusedWorker(f"{spec.url} is this router's own address (--host {cfg.host} --port {cfg.port})")
        existing = self.registry.get(spec.url)
        worker = self.registry.add(spec, source)
        if worker is existing:  # a removal called off: it was registered (and checked) before
            await self.registry.probe(worker)
            return worker
        try:
            await self.registry.probe(worker)
        except BaseException:  # cancelled (shutdown): not half-registered
            self.registry.discard(worker)
            raise
        if worker.is_router:
            self.registry.discard(worker)
            raise RefusedWorker(f"{spec.url} is this router itself (its /health answered with the router's id)")
        return worker

    def remove_worker(self, url: str) -> Worker | None:
        """Drain the worker at `url` (out of rotation now, gone when its legs are done);
        None when there is no such worker."""
        worker = self.registry.get(url)
        if worker is not None:
            self.registry.remove(worker)
        return worker

    def _forget_worker(self, worker: Worker) -> None:
        for policy in (self.proxy.prefill_policy, self.proxy.decode_policy):
            if policy is not None:
                policy.remove_worker(worker.url)
        self.metrics.forget_worker(worker.role, worker.url)

    def missing_roles(self) -> list[str]:
        return [r for r in self.roles if not self.registry.healthy(r)]

    async def worker_info(self, w: Worker) -> dict[str, Any]:
        try:
            r = await w.client.get(w.url + "/get_server_info", headers=self.worker_headers,
                                      timeout=INFO_TIMEOUT_S)
            info = r.json() if r.status_code == 200 else {"error": f"HTTP {r.status_code}: {r.text[:300]}"}
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:  # RuntimeError: removed meanwhile
            info = {"error": f"{type(exc).__name__}: {exc}"}
        return {**info, **w.describe()}
