"""Kubernetes pod discovery against the kubernetes client's own API shapes: real
V1Pod / V1PodList objects, fed as watch events ({"type", "object"}) through an
injected stream function (no cluster), to a router in front of fake workers, each on
its own loopback address (pods share the server port)."""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import subprocess
import sys
import threading
from typing import Any, Iterator

import httpx
import pytest
# The 'test' extra installs the client (the 'k8s' extra): no skip when it is missing.
from kubernetes.client import V1ListMeta, V1ObjectMeta, V1Pod, V1PodCondition, V1PodList, V1PodStatus

from pdserve.router.app import create_app
from pdserve.router.config import ConfigError, from_cli
from pdserve.router.discovery import PodDiscovery, pod_is_ready, pod_url
from pdserve.router.fake_worker import FakeWorker, ThreadedServer
from tests.server.conftest import REPO_ROOT
from tests.waiting import wait_until

COMPLETION = {"prompt": "hello", "max_tokens": 3}
PREFILL_SEL = "app=pdserve,component=prefill"
DECODE_SEL = "app=pdserve,component=decode"


def pod(name: str, ip: str | None, *, ready: bool = True, phase: str = "Running", component: str = "decode",
        annotations: dict[str, str] | None = None, deleting: bool = False) -> V1Pod:
    return V1Pod(
        metadata=V1ObjectMeta(name=name, namespace="serving", labels={"app": "pdserve", "component": component},
                              annotations=annotations,
                              deletion_timestamp=datetime.datetime.now(datetime.timezone.utc) if deleting else None),
        status=V1PodStatus(phase=phase, pod_ip=ip, conditions=[
            V1PodCondition(type="PodScheduled", status="True"),
            V1PodCondition(type="Ready", status="True" if ready else "False")]))


class FakeCluster:
    """list_namespaced_pod and Watch().stream as the router calls them: a list per label
    selector, then the events the test pushes on that selector's queue."""

    def __init__(self, pods: dict[str, list[V1Pod]]) -> None:
        self.pods = pods
        self.queues: dict[str, queue.Queue] = {sel: queue.Queue() for sel in pods}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.closed = threading.Event()

    def list_namespaced_pod(self, namespace: str, label_selector: str, **kwargs: Any) -> V1PodList:
        self.calls.append(("list", {"namespace": namespace, "label_selector": label_selector, **kwargs}))
        return V1PodList(items=list(self.pods[label_selector]), metadata=V1ListMeta(resource_version="41"))

    def stream(self, func: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
        assert func == self.list_namespaced_pod  # Watch().stream(list_namespaced_pod, ...)
        self.calls.append(("watch", kwargs))
        q = self.queues[kwargs["label_selector"]]
        while not self.closed.is_set():
            try:
                yield q.get(timeout=0.05)
            except queue.Empty:
                continue

    def push(self, selector: str, kind: str, obj: V1Pod) -> None:
        self.queues[selector].put({"type": kind, "object": obj})


@contextlib.contextmanager
def loopback_servers(*roles: str) -> Iterator[tuple[int, list[tuple[FakeWorker, str]]]]:
    """One fake worker per role on 127.0.0.2, .3, ... all on one port (as pods are)."""
    with contextlib.ExitStack() as stack:
        out: list[tuple[FakeWorker, str]] = []
        port = 0
        for i, role in enumerate(roles, start=2):
            w = FakeWorker(role)
            server = stack.enter_context(ThreadedServer(w.app(), host=f"127.0.0.{i}", port=port))
            port = server.port
            out.append((w, f"127.0.0.{i}"))
        yield port, out


@contextlib.contextmanager
def discovered_router(cluster: FakeCluster, port: int, *flags: str) -> Iterator[tuple[httpx.Client, Any]]:
    cfg = from_cli(["--pd-disaggregation", "--service-discovery", "--prefill-selector", "app=pdserve",
                    "component=prefill", "--decode-selector", "app=pdserve,component=decode",
                    "--service-discovery-namespace", "serving", "--service-discovery-port", str(port),
                    "--health-check-interval", "0.2", *flags])
    discovery = PodDiscovery.from_config(cfg, stream=cluster.stream, list_pods=cluster.list_namespaced_pod,
                                         retry_s=0.1)
    app = create_app(cfg, discovery=discovery)
    with ThreadedServer(app) as router, httpx.Client(base_url=router.url, timeout=30) as client:
        try:
            yield client, discovery
        finally:
            cluster.closed.set()


def workers(client: httpx.Client) -> dict[str, dict]:
    return {w["url"]: w for w in client.get("/workers").json()["workers"]}


def test_pods_join_when_ready_and_are_drained_when_they_go():
    with loopback_servers("prefill", "decode", "decode") as (port, ((p0, ip0), (d0, ip1), (d1, ip2))):
        _join_and_leave(port, p0, ip0, d0, ip1, d1, ip2)


def _join_and_leave(port: int, p0: FakeWorker, ip0: str, d0: FakeWorker, ip1: str, d1: FakeWorker, ip2: str) -> None:
    url_p, url_d0, url_d1 = (f"http://{ip}:{port}" for ip in (ip0, ip1, ip2))
    prefill_pod = pod("prefill-0", ip0, component="prefill", annotations={"pdserve/bootstrap-port": "9100"})
    cluster = FakeCluster({PREFILL_SEL: [prefill_pod], DECODE_SEL: []})
    with discovered_router(cluster, port) as (client, discovery):
        # The listed prefill pod is in; no decode pod yet: not healthy.
        wait_until(lambda: workers(client).get(url_p, {}).get("state") == "healthy")
        assert workers(client)[url_p]["bootstrap_port"] == 9100 and workers(client)[url_p]["source"] == "discovery"
        assert client.get("/health").status_code == 503
        # A decode pod scheduled but not ready (no IP yet, then an IP but not Ready): not in.
        cluster.push(DECODE_SEL, "ADDED", pod("decode-0", None, ready=False, phase="Pending"))
        cluster.push(DECODE_SEL, "MODIFIED", pod("decode-0", ip1, ready=False))
        wait_until(lambda: discovery.events_seen == 2)
        assert url_d0 not in workers(client)
        cluster.push(DECODE_SEL, "MODIFIED", pod("decode-0", ip1))
        wait_until(lambda: workers(client).get(url_d0, {}).get("in_rotation"))
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 200, r.text
        (sent,) = [b for _, b in p0.requests]
        assert sent["bootstrap_host"] == ip0 and sent["bootstrap_port"] == 9100
        assert len(d0.requests) == 1
        # A second decode pod; a repeated MODIFIED of a ready pod changes nothing.
        cluster.push(DECODE_SEL, "ADDED", pod("decode-1", ip2))
        cluster.push(DECODE_SEL, "MODIFIED", pod("decode-0", ip1))
        wait_until(lambda: workers(client).get(url_d1, {}).get("in_rotation"))
        assert len(workers(client)) == 3
        # decode-0 terminating (deletion timestamp set, still Ready): drained, then gone.
        cluster.push(DECODE_SEL, "MODIFIED", pod("decode-0", ip1, deleting=True))
        wait_until(lambda: url_d0 not in workers(client))
        for _ in range(2):
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
        assert len(d0.requests) == 1 and len(d1.requests) == 2
        # DELETED: the prefill pod goes, the router has no prefill left.
        cluster.push(PREFILL_SEL, "DELETED", prefill_pod)
        wait_until(lambda: url_p not in workers(client))
        assert client.get("/health").status_code == 503
    # The router listed, then watched from the list's version, per selector, in its namespace.
    watches = {kw["label_selector"]: kw for kind, kw in cluster.calls if kind == "watch"}
    assert set(watches) == {PREFILL_SEL, DECODE_SEL}
    assert all(kw["namespace"] == "serving" and kw["resource_version"] == "41" for kw in watches.values())


def test_a_pod_missing_from_a_new_list_is_removed():
    """A DELETED event missed while the watch was down: the next list reconciles."""
    with loopback_servers("prefill", "decode") as (port, ((_, ip0), (_, ip1))):
        cluster = FakeCluster({PREFILL_SEL: [pod("p", ip0, component="prefill")], DECODE_SEL: [pod("d", ip1)]})
        with discovered_router(cluster, port) as (client, _):
            wait_until(lambda: client.get("/health").status_code == 200)
            assert workers(client)[f"http://{ip0}:{port}"]["bootstrap_port"] == 8998  # no annotation: default
            cluster.pods[DECODE_SEL] = []
            # The watch fails (as on a dropped connection or a 410): the thread lists again.
            cluster.queues[DECODE_SEL].put({"type": "ERROR", "object": {"code": 410, "reason": "Gone"}})
            wait_until(lambda: f"http://{ip1}:{port}" not in workers(client))
            assert client.get("/health").status_code == 503


def test_pod_shapes():
    assert pod_is_ready(pod("a", "10.0.0.1"))
    assert not pod_is_ready(pod("a", "10.0.0.1", ready=False))
    assert not pod_is_ready(pod("a", None))
    assert not pod_is_ready(pod("a", "10.0.0.1", phase="Succeeded"))
    assert not pod_is_ready(pod("a", "10.0.0.1", deleting=True))
    assert not pod_is_ready(V1Pod(metadata=V1ObjectMeta(name="a"), status=None))
    assert pod_url(pod("a", "10.0.0.1"), 30000) == "http://10.0.0.1:30000"
    assert pod_url(pod("a", "fd00::1"), 30000) == "http://[fd00::1]:30000"
    cfg = from_cli(["--pd-disaggregation", "--service-discovery", "--prefill-selector", "c=p",
                    "--decode-selector", "c=d"])
    d = PodDiscovery.from_config(cfg, stream=lambda *a, **k: iter(()), list_pods=lambda **k: None)
    assert d._spec("prefill", pod("p", "10.0.0.1", annotations={"pdserve/bootstrap-port": "none"}),
                   "ns/p").bootstrap_port is None
    assert d._spec("prefill", pod("p", "10.0.0.1", annotations={"pdserve/bootstrap-port": "x"}), "ns/p") is None
    assert d.namespace == "default" and d.port == 30000


def test_discovery_flags():
    cfg = from_cli(["--pd-disaggregation", "--service-discovery", "--prefill-selector", "app=a", "role=p",
                    "--decode-selector", "app=a,role=d", "--service-discovery-namespace", "ns",
                    "--service-discovery-port", "8080", "--bootstrap-port-annotation", "x/bp"])
    assert cfg.prefill_selector == (("app", "a"), ("role", "p")) and cfg.decode_selector == (("app", "a"),
                                                                                             ("role", "d"))
    assert (cfg.service_discovery_namespace, cfg.service_discovery_port, cfg.bootstrap_port_annotation) == \
        ("ns", 8080, "x/bp")
    assert not cfg.prefill and not cfg.decode  # pods join at run time
    plain = from_cli(["--service-discovery", "--selector", "app=colocated"])
    assert plain.selector == (("app", "colocated"),) and not plain.pd_disaggregation
    for argv, flag in [
        (["--pd-disaggregation", "--service-discovery", "--prefill-selector", "a=b"], "--decode-selector"),
        (["--service-discovery"], "--selector"),
        (["--pd-disaggregation", "--service-discovery", "--prefill-selector", "a", "--decode-selector", "a=b"],
         "--prefill-selector"),
        (["--worker-urls", "http://h:1", "--selector", "a=b"], "--service-discovery"),
        (["--service-discovery", "--selector", "a=b", "--service-discovery-port", "0"], "--service-discovery-port"),
    ]:
        with pytest.raises(ConfigError) as exc:
            from_cli(argv)
        assert flag in str(exc.value), (argv, exc.value)


def test_refused_without_the_kubernetes_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes: ImportError
    cfg = from_cli(["--service-discovery", "--selector", "app=x"])
    with pytest.raises(ConfigError) as exc:
        create_app(cfg)
    assert "--service-discovery" in str(exc.value) and "pip install" in str(exc.value)


def test_default_stream_is_the_clients_watch(monkeypatch):
    """Without injected functions the kubernetes client is used: in-cluster credentials,
    else a kubeconfig (here a minimal one), CoreV1Api().list_namespaced_pod, Watch()."""
    import kubernetes.config as kconfig
    from kubernetes import client, watch

    monkeypatch.setattr(kconfig, "load_incluster_config",
                        lambda: (_ for _ in ()).throw(kconfig.ConfigException("not in a pod")))
    monkeypatch.setattr(kconfig, "load_kube_config", lambda: None)
    cfg = from_cli(["--service-discovery", "--selector", "app=x", "--service-discovery-namespace", "ns"])
    d = PodDiscovery.from_config(cfg)
    assert d.list_pods.__func__ is client.CoreV1Api.list_namespaced_pod
    assert d.stream.watch_cls is watch.Watch and d.namespace == "ns"  # (never started: nothing contacted)


@pytest.mark.parametrize("prelude, message", [
    ("import sys; sys.modules['kubernetes'] = None", "needs the kubernetes Python client"),
    ("", "no Kubernetes credentials"),  # not in a pod, no kubeconfig
])
def test_cli_refuses_discovery_it_cannot_run(tmp_path, prelude, message):
    code = f"{prelude}\nfrom pdserve.router.__main__ import main\nmain(['--service-discovery', '--selector', 'app=x'])"
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**env, "HOME": str(tmp_path)}, cwd=str(REPO_ROOT))
    assert r.returncode == 2, r.stderr
    assert "--service-discovery" in r.stderr and message in r.stderr and "Traceback" not in r.stderr


def test_a_pod_ready_again_while_draining_stays():
    """Readiness flapped: the drain it started is called off, its in-flight request and
    its place in rotation kept."""
    with loopback_servers("prefill", "decode") as (port, ((_, ip0), (d0, ip1))):
        cluster = FakeCluster({PREFILL_SEL: [pod("p", ip0, component="prefill")], DECODE_SEL: [pod("d", ip1)]})
        url = f"http://{ip1}:{port}"
        d0.faults.gate = threading.Event()
        with discovered_router(cluster, port) as (client, discovery):
            wait_until(lambda: client.get("/health").status_code == 200)
            answer: dict = {}

            def held_request() -> None:
                with httpx.Client(base_url=client.base_url, timeout=30) as c:
                    answer["r"] = c.post("/v1/completions", json=COMPLETION)
            t = threading.Thread(target=held_request)
            t.start()
            wait_until(lambda: workers(client)[url]["in_flight"] == 1)
            cluster.push(DECODE_SEL, "MODIFIED", pod("d", ip1, ready=False))
            wait_until(lambda: workers(client)[url]["state"] == "removing")
            cluster.push(DECODE_SEL, "MODIFIED", pod("d", ip1))
            wait_until(lambda: workers(client)[url]["state"] == "healthy")
            d0.faults.gate.set()
            t.join(30)
            assert answer["r"].status_code == 200
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
            assert len(d0.requests) == 2 and workers(client)[url]["in_rotation"]
