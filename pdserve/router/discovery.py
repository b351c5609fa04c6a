"""Kubernetes pod discovery: workers join and leave the router as pods matching label
selectors become ready or go, through the same add / remove path as POST and DELETE
/workers (Router.add_worker / Router.remove_worker).

One background thread per role (prefill, decode; or the colocated workers) lists the
matching pods, reconciles (a known pod missing from the list is removed: its DELETED
event may have been missed while the watch was down), then watches from the list's
resource version with `kubernetes.watch.Watch().stream(CoreV1Api().list_namespaced_pod,
namespace, label_selector=...)`. When the watch ends (its server-side timeout, an
expired resource version, a dropped connection) the thread lists again.

A pod is a worker while it is Running, has a pod IP, its Ready condition is True and it
is not being deleted; its URL is http://POD_IP:--service-discovery-port. A prefill
pod's bootstrap port is its `--bootstrap-port-annotation` (default
pdserve/bootstrap-port; absent: 8998, "none": the servers' own default). A pod that
stops being a worker (not ready, terminating, deleted) is drained: no new requests,
in-flight ones finish, then it is removed. A pod ready again while still draining stays.

The kubernetes package is optional (`pip install 'pdserve[k8s]'`): --service-discovery
without it is refused with a ConfigError saying so.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from pdserve.router.config import DEFAULT_BOOTSTRAP_PORT, ConfigError, RouterConfig, WorkerSpec, \
    parse_bootstrap_port
from pdserve.router.urls import UrlError, canonical_url
from pdserve.router.workers import DuplicateWorker, RefusedWorker

if TYPE_CHECKING:
    from pdserve.router.core import Router

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_TIMEOUT_S = 300    # the API server ends each watch after this; the thread lists again
RETRY_S = 2.0            # after a failed list or watch
CALL_TIMEOUT_S = 30.0    # a thread's wait for the router's event loop to add / remove a worker

# (func, **kwargs) -> watch events {"type": ..., "object": V1Pod}: Watch().stream's signature
StreamFn = Callable[..., Iterable[dict[str, Any]]]
# (namespace=..., label_selector=...) -> V1PodList: CoreV1Api().list_namespaced_pod's
ListFn = Callable[..., Any]


def label_selector(pairs: Iterable[tuple[str, str]]) -> str:
    return ",".join(f"{k}={v}" for k, v in pairs)


def default_namespace() -> str:
    """The router pod's own namespace (what a namespaced Role grants), else 'default'."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def pod_is_ready(pod: Any) -> bool:
    status, meta = pod.status, pod.metadata
    if status is None or meta is None or meta.deletion_timestamp is not None:
        return False  # terminating: its preStop drain is under way, send it nothing new
    if status.phase != "Running" or not status.pod_ip:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())


def pod_url(pod: Any, port: int) -> str:
    """The pod's URL in the canonical form every worker URL takes (urls.py), so that a pod
    is the same worker as a POST /workers or a flag naming its address."""
    ip = pod.status.pod_ip
    return canonical_url(f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}")


@dataclass(frozen=True)
class RoleWatch:
    role: str                       # the registry's role: prefill, decode or plain
    selector: str                   # label selector, key=value,...


class _KubeStream:
    """Watch().stream with one Watch per thread, so that stop() can end them all."""

    def __init__(self, watch_cls: Any) -> None:
        self.watch_cls = watch_cls
        self._watches: dict[int, Any] = {}

    def __call__(self, func: Callable[..., Any], **kwargs: Any) -> Iterable[dict[str, Any]]:
        w = self.watch_cls()
        self._watches[threading.get_ident()] = w
        return w.stream(func, **kwargs)

    def stop(self) -> None:
        for w in list(self._watches.values()):
            w.stop()


class PodDiscovery:
    def __init__(self, roles: Iterable[RoleWatch], *, namespace: str, port: int, annotation: str,
                 stream: StreamFn, list_pods: ListFn, watch_timeout_s: int | None = WATCH_TIMEOUT_S,
                 retry_s: float = RETRY_S, on_stop: Callable[[], None] | None = None) -> None:
        self.roles = tuple(roles)
        self.namespace = namespace
        self.port = port
        self.annotation = annotation
        self.stream = stream
        self.list_pods = list_pods
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self.on_stop = on_stop
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._router: "Router | None" = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._known: dict[str, dict[str, str]] = {r.role: {} for r in self.roles}  # role -> pod -> url
        self.events_seen = 0  # watch events handled (tests wait on it)

    @staticmethod
    def roles_of(cfg: RouterConfig) -> list[RoleWatch]:
        if cfg.pd_disaggregation:
            return [RoleWatch("prefill", label_selector(cfg.prefill_selector)),
                    RoleWatch("decode", label_selector(cfg.decode_selector))]
        return [RoleWatch("plain", label_selector(cfg.selector))]

    @classmethod
    def from_config(cls, cfg: RouterConfig, *, stream: StreamFn | None = None,
                    list_pods: ListFn | None = None, **kwargs: Any) -> "PodDiscovery":
        """With `stream` and `list_pods` given (tests), the kubernetes client is not
        loaded; otherwise it is (in-cluster credentials, else ~/.kube/config)."""
        on_stop = None
        if stream is None or list_pods is None:
            try:
                from kubernetes import client, config, watch
            except ImportError:
                raise ConfigError("--service-discovery: needs the kubernetes Python client, which is not "
                                  "installed (pip install 'pdserve[k8s]', or pip install kubernetes)") from None
            try:
                config.load_incluster_config()
            except config.ConfigException:
                try:
                    config.load_kube_config()
                except Exception as exc:  # the client raises several kinds here
                    raise ConfigError(f"--service-discovery: no Kubernetes credentials (not in a pod, and "
                                      f"no usable kubeconfig): {exc}") from None
            api = client.CoreV1Api()
            kube_stream = _KubeStream(watch.Watch)
            stream, list_pods, on_stop = stream or kube_stream, list_pods or api.list_namespaced_pod, \
                kube_stream.stop
        return cls(cls.roles_of(cfg), namespace=cfg.service_discovery_namespace or default_namespace(),
                   port=cfg.service_discovery_port, annotation=cfg.bootstrap_port_annotation, stream=stream,
                   list_pods=list_pods, on_stop=on_stop, **kwargs)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, router: "Router", loop: asyncio.AbstractEventLoop) -> None:
        self._router, self._loop = router, loop
        for rw in self.roles:
            t = threading.Thread(target=self._run, args=(rw,), name=f"pdserve-discovery-{rw.role}", daemon=True)
            t.start()
            self._threads.append(t)
        logger.info("Kubernetes discovery: watching pods in namespace %s (%s)", self.namespace,
                    "; ".join(f"{r.role}: {r.selector}" for r in self.roles))

    def stop(self, join_s: float = 2.0) -> None:
        self._stop.set()
        if self.on_stop is not None:
            self.on_stop()
        for t in self._threads:
            # A watch blocked on the network ends with its next event or its timeout; the
            # threads are daemons, so a router shutting down never waits on them for long.
            t.join(join_s)

    # ---- the watch loop -------------------------------------------------------------------
    def _run(self, rw: RoleWatch) -> None:
        while not self._stop.is_set():
            try:
                listed = self.list_pods(namespace=self.namespace, label_selector=rw.selector)
                self._reconcile(rw.role, listed.items or [])
                kwargs: dict[str, Any] = {"namespace": self.namespace, "label_selector": rw.selector}
                version = listed.metadata.resource_version if listed.metadata is not None else None
                if version:
                    kwargs["resource_version"] = version
                if self.watch_timeout_s is not None:
                    kwargs["timeout_seconds"] = self.watch_timeout_s
                for event in self.stream(self.list_pods, **kwargs):
                    if self._stop.is_set():
                        return
                    self.handle_event(rw.role, event)
            except Exception as exc:  # never let the thread die: log, wait, list again
                if self._stop.is_set():
                    return
                logger.warning("Kubernetes discovery (%s pods, %s): %s: %s; listing again in %.0f s", rw.role,
                               rw.selector, type(exc).__name__, exc, self.retry_s)
                self._stop.wait(self.retry_s)

    def _reconcile(self, role: str, pods: list[Any]) -> None:
        listed = {self._key(p) for p in pods}
        for key in [k for k in self._known[role] if k not in listed]:
            self._remove(self._known[role].pop(key), f"pod {key} is gone")
        for pod in pods:
            self._apply(role, pod, deleted=False)

    def handle_event(self, role: str, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "ERROR":  # e.g. 410 Gone: the resource version expired; list again
            raise RuntimeError(f"watch error: {event.get('raw_object') or event.get('object')}")
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return  # BOOKMARK and the like carry no pod change
        self._apply(role, event["object"], deleted=kind == "DELETED")
        self.events_seen += 1

    def _key(self, pod: Any) -> str:
        return f"{pod.metadata.namespace or self.namespace}/{pod.metadata.name}"

    def _apply(self, role: str, pod: Any, deleted: bool) -> None:
        key = self._key(pod)
        known = self._known[role]
        spec = None if deleted or not pod_is_ready(pod) else self._spec(role, pod, key)
        previous = known.get(key)
        if previous is not None and (spec is None or spec.url != previous):
            del known[key]
            self._remove(previous, f"pod {key} is {'deleted' if deleted else 'not ready'}")
        if spec is not None:
            known[key] = spec.url
            self._add(spec, key)

    def _spec(self, role: str, pod: Any, key: str) -> WorkerSpec | None:
        try:
            url = pod_url(pod, self.port)
        except UrlError as exc:  # an API server's pod IP we cannot read: leave the pod out
            logger.warning("Kubernetes discovery: pod %s: %s; the pod is left out", key, exc)
            return None
        if role != "prefill":
            return WorkerSpec(url, role)
        value = (pod.metadata.annotations or {}).get(self.annotation)
        if value is None:
            return WorkerSpec(url, role, DEFAULT_BOOTSTRAP_PORT)
        try:
            return WorkerSpec(url, role, parse_bootstrap_port(value, f"pod {key} annotation {self.annotation}"))
        except ConfigError as exc:
            # A wrong port would fail every transfer: better no traffic and a clear log line.
            logger.warning("Kubernetes discovery: %s; the pod is left out", exc)
            return None

    # ---- into the router's event loop -----------------------------------------------------
    def _call(self, coro: Any) -> Any:
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(CALL_TIMEOUT_S)
        except FutureTimeout:
            future.cancel()
            raise

    def _add(self, spec: WorkerSpec, key: str) -> None:
        router = self._router
        assert router is not None

        async def add() -> None:
            existing = router.registry.get(spec.url)
            if existing is not None and not existing.removing:
                if existing.spec != spec:
                    logger.warning("Kubernetes discovery: pod %s at %s is already a %s worker; not changed",
                                   key, spec.url, existing.role)
                return  # a MODIFIED event of a pod already in
            try:
                await router.add_worker(spec, "discovery")
            except (DuplicateWorker, RefusedWorker) as exc:  # being removed with another role / port; us
                logger.warning("Kubernetes discovery: pod %s: %s", key, exc)
        self._call(add())

    def _remove(self, url: str, why: str) -> None:
        router = self._router
        assert router is not None

        async def remove() -> None:
            if router.remove_worker(url) is not None:
                logger.info("Kubernetes discovery: %s: draining %s", why, url)
        self._call(remove())
