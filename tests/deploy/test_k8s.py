"""deploy/k8s: every manifest is valid Kubernetes (kubernetes-validate's bundled schemas,
strict, offline), every pdserve container runs a command the servers' and the router's own
argument parsers accept, and the wiring holds: probes on /health at the server's port, a
preStop drain, terminationGracePeriodSeconds above the drain timeout, the router's
selectors matching the pods, the bootstrap annotation matching the prefill flag, RBAC
that lets the router watch pods, the GPU variant asking for a GPU.

(No cluster runs here; `kubectl apply --dry-run=server` is the next step on one.)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest
import yaml

from pdserve.config import ServerArgs
from pdserve.router import config as router_config

pytestmark = pytest.mark.fast

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# A recent Kubernetes whose schemas kubernetes-validate bundles (it reads no network).
K8S_VERSION = "1.33.0"
# After the drain: uvicorn writes out the last responses (5 s), the children stop (10 s).
EXIT_MARGIN_S = 15
VARIANTS = ("cpu", "gpu")


def manifest_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def objects(*paths: Path) -> list[dict[str, Any]]:
    return [d for p in paths for d in documents(p)]


def variant(name: str) -> list[dict[str, Any]]:
    """What `kubectl apply -f namespace.yaml -f router.yaml -f <variant>/` creates."""
    return objects(K8S / "namespace.yaml", K8S / "router.yaml", *sorted((K8S / name).glob("*.yaml")))


def deployments(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Deployments by their component label."""
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in objs if d["kind"] == "Deployment"}


def container(deploy: dict[str, Any]) -> dict[str, Any]:
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    return c


def expand(c: dict[str, Any]) -> list[str]:
    """The container's argv as the kubelet runs it: command + args, `$(VAR)` replaced by a
    stand-in for each variable the container defines. A reference to an undefined variable
    would stay literal in the pod: refused here."""
    env = {e["name"] for e in c.get("env", ())}
    argv = list(c.get("command", ())) + list(c.get("args", ()))
    for arg in argv:
        for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
            assert name in env, f"{c['name']}: $({name}) is not defined in the container's env"
    # 32 characters: what `openssl rand -hex 16` gives (secrets must be >= 16).
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: f"stand-in-{m.group(1)}"[:32].ljust(32, "x"), a)
            for a in argv]


def module_args(argv: list[str]) -> tuple[str, list[str]]:
    assert argv[:2] == ["python", "-m"], argv
    return argv[2], argv[3:]


def server_args(c: dict[str, Any], tmp_path: Path) -> ServerArgs:
    """The server's ServerArgs from its container. Paths on mounted volumes (the GPU
    variant's model) do not exist here: each must lie under one of the container's
    volumeMounts, and a stand-in directory takes its place for parsing."""
    module, argv = module_args(expand(c))
    assert module == "pdserve.launch_server"
    mounts = [m["mountPath"] for m in c.get("volumeMounts", ())]
    for i, arg in enumerate(argv[:-1]):
        if arg in ("--model-path", "--tokenizer-path", "--speculative-draft-model-path"):
            path = argv[i + 1]
            assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), (path, mounts)
            stand_in = tmp_path / path.strip("/").replace("/", "_")
            stand_in.mkdir(exist_ok=True)
            argv[i + 1] = str(stand_in)
    return ServerArgs.from_cli(argv)  # raises on any unknown or invalid flag


# ---- (a) schemas -------------------------------------------------------------------------------
def test_manifests_exist():
    names = {str(p.relative_to(K8S)) for p in manifest_files()}
    assert {"namespace.yaml", "router.yaml", "cpu/prefill.yaml", "cpu/decode.yaml", "gpu/prefill.yaml",
            "gpu/decode.yaml", "gpu/models-pvc.yaml"} <= names, names


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_is_valid_kubernetes(path):
    docs = documents(path)
    assert docs, path
    for doc in docs:
        # strict: an unknown or misspelt field is an error too, not ignored.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "pdserve", doc["metadata"]


def test_validation_catches_a_broken_manifest():
    """The check above can fail: a misspelt field and a wrong type are refused."""
    deploy = deployments(variant("cpu"))["prefill"]
    broken = yaml.safe_load(yaml.safe_dump(deploy))
    broken["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 90
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(deploy))
    broken["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


# ---- (b), (c) commands, probes, drain ----------------------------------------------------------
def server_deployments() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for name in VARIANTS:
        for role, deploy in deployments(variant(name)).items():
            if role != "router":
                yield name, role, deploy


@pytest.mark.parametrize("name,role,deploy", list(server_deployments()),
                         ids=[f"{n}-{r}" for n, r, _ in server_deployments()])
def test_server_command_probes_and_drain(name, role, deploy, tmp_path):
    c = container(deploy)
    args = server_args(c, tmp_path)
    assert args.disaggregation_mode == role and args.host == "0.0.0.0"
    # Beyond loopback the PD control plane is authenticated, from the Secret.
    assert args.disaggregation_secret is not None
    env = {e["name"]: e for e in c["env"]}
    assert env["PDSERVE_PD_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "pdserve-secrets", "key": "pd-secret"}
    assert args.admin_api_key is not None and args.max_queued_requests is not None
    ports = {p["containerPort"] for p in c["ports"]}
    assert args.port in ports
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": args.port}, (probe, c[probe])
    # Readiness drops the pod at the first 503 "draining".
    assert c["readinessProbe"].get("failureThreshold", 3) == 1
    # The drain: preStop POSTs /drain with the admin key, on the server's port.
    hook = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert "-X POST" in hook and f"http://127.0.0.1:{args.port}/drain" in hook, hook
    assert "Bearer $PDSERVE_ADMIN_API_KEY" in hook and "PDSERVE_ADMIN_API_KEY" in env, hook
    grace = deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > args.graceful_shutdown_timeout
    assert grace >= args.graceful_shutdown_timeout + EXIT_MARGIN_S, (grace, args.graceful_shutdown_timeout)
    # A rolling update brings the new pod up before an old one drains.
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    meta = deploy["spec"]["template"]["metadata"]
    if role == "prefill":
        assert args.disaggregation_bootstrap_port in ports
        assert meta["annotations"]["pdserve.io/bootstrap-port"] == str(args.disaggregation_bootstrap_port)
    limits = c["resources"].get("limits", {})
    if name == "gpu":
        assert limits.get("nvidia.com/gpu") == 1 and args.model_path is not None
        assert c["image"].endswith(":cuda")
    else:
        # The CPU demo serves the embedded demo model: no --model-path, no GPU.
        assert "nvidia.com/gpu" not in limits and args.model_path is None
        assert args.device == "auto"


@pytest.mark.parametrize("name", VARIANTS)
def test_router_discovers_the_variant_pods(name, tmp_path):
    objs = variant(name)
    deploys = deployments(objs)
    c = container(deploys["router"])
    module, argv = module_args(expand(c))
    assert module == "pdserve.router"
    cfg = router_config.from_cli(argv)  # raises on any unknown or invalid flag
    assert cfg.pd_disaggregation and cfg.service_discovery and cfg.host == "0.0.0.0"
    assert cfg.service_discovery_namespace == "pdserve"
    for role, selector in (("prefill", cfg.prefill_selector), ("decode", cfg.decode_selector)):
        labels = deploys[role]["spec"]["template"]["metadata"]["labels"]
        assert selector and all(labels.get(k) == v for k, v in selector), (role, selector, labels)
        # The prefill selector must not also pick decode pods, nor the reverse.
        other = deploys["decode" if role == "prefill" else "prefill"]["spec"]["template"]["metadata"]["labels"]
        assert not all(other.get(k) == v for k, v in selector), (role, selector)
        assert server_args(container(deploys[role]), tmp_path).port == cfg.service_discovery_port
    prefill_meta = deploys["prefill"]["spec"]["template"]["metadata"]
    assert cfg.bootstrap_port_annotation in prefill_meta["annotations"]
    # The router and the servers share the admin key (it aborts PD legs with it).
    assert cfg.admin_api_key is not None
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": cfg.port}
    # Its Service fronts it on its port.
    (svc,) = [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "pdserve"]
    assert svc["spec"]["selector"] == deploys["router"]["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == cfg.port


def test_router_rbac_allows_watching_pods():
    objs = objects(K8S / "router.yaml")
    deploy = deployments(objs)["router"]
    account = deploy["spec"]["template"]["spec"]["serviceAccountName"]
    (sa,) = [o for o in objs if o["kind"] == "ServiceAccount"]
    (role,) = [o for o in objs if o["kind"] == "Role"]
    (binding,) = [o for o in objs if o["kind"] == "RoleBinding"]
    assert sa["metadata"]["name"] == account
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert {"kind": "ServiceAccount", "name": account, "namespace": "pdserve"} in binding["subjects"]
    pods = [r for r in role["rules"] if "pods" in r["resources"] and r["apiGroups"] == [""]]
    assert pods and {"get", "list", "watch"} <= set(pods[0]["verbs"]), role["rules"]
    # Nothing beyond reading pods.
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in role["rules"])


def test_services_select_their_pods():
    for name in VARIANTS:
        objs = variant(name)
        deploys = deployments(objs)
        for svc in (o for o in objs if o["kind"] == "Service"):
            matching = [r for r, d in deploys.items()
                        if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v
                               for k, v in svc["spec"]["selector"].items())]
            assert len(matching) == 1, (name, svc["metadata"]["name"], matching)
            ports = {p["containerPort"] for p in container(deploys[matching[0]])["ports"]}
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, svc
