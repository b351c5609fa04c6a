"""deploy/k8s: every manifest is valid Kubernetes (kubernetes-validate's bundled schemas,
strict, offline), every pdserve container runs a command the servers' and the router's own
argument parsers accept, and the wiring holds: probes on /health at the server's port
with thresholds one slow answer does not trip, the router alive on /liveness and ready on
/health, a preStop drain whose key never is an argument, terminationGracePeriodSeconds
above the drain timeout, secrets mounted as files (no `$(VAR)` in any command), the
router's selectors matching the pods, the bootstrap annotation matching the prefill flag,
RBAC that lets the router watch pods, the GPU variant asking for a GPU and tolerating GPU
taints, its model volume written by the download Job (with an optional Hugging Face token
file) and read by the servers.

(No cluster runs here; `kubectl apply --dry-run=server` is the next step on one.)
"""

from __future__ import annotations

import ast
import importlib
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


# Flags whose value is a secret: never in a command (`ps` and /proc/PID/cmdline show it).
SECRET_FLAGS = ("--disaggregation-secret", "--admin-api-key", "--api-key")


def expand(c: dict[str, Any]) -> list[str]:
    """The container's argv as the kubelet runs it: command + args. No `$(VAR)` at all:
    the kubelet would put the variable's value (a Secret's, here) in the arguments."""
    argv = list(c.get("command", ())) + list(c.get("args", ()))
    for arg in argv:
        assert not re.search(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg), f"{c['name']}: {arg!r} expands a variable"
    assert not set(argv) & set(SECRET_FLAGS), f"{c['name']}: a secret as a flag value: {argv}"
    return argv


def secret_volumes(deploy: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The pod's secret volumes by name."""
    return {v["name"]: v["secret"] for v in deploy["spec"]["template"]["spec"].get("volumes", ()) if "secret" in v}


def mounted_secret_file(deploy: dict[str, Any], c: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in container `c`: it must lie in a secret
    volume the container mounts read-only, under a key that volume projects."""
    volumes = secret_volumes(deploy)
    for m in c.get("volumeMounts", ()):
        if m["name"] in volumes and path.startswith(m["mountPath"].rstrip("/") + "/"):
            assert m.get("readOnly") is True, m
            secret, key = volumes[m["name"]], path[len(m["mountPath"].rstrip("/")) + 1:]
            items = secret.get("items")
            assert items is None or key in {i["path"] for i in items}, (key, items)
            key = next((i["key"] for i in items if i["path"] == key), key) if items else key
            return secret["secretName"], key
    raise AssertionError(f"{c['name']}: {path} is in no secret volume it mounts")


def module_args(argv: list[str]) -> tuple[str, list[str]]:
    assert argv[:2] == ["python", "-m"], argv
    return argv[2], argv[3:]


def with_stand_ins(deploy: dict[str, Any], c: dict[str, Any], argv: list[str], tmp_path: Path) -> list[str]:
    """Paths on mounted volumes do not exist here: a model directory must lie under one of
    the container's volumeMounts, a secret file (`--*-file`) in a secret volume it mounts
    (mounted_secret_file); a stand-in directory / file takes its place for parsing."""
    mounts = [m["mountPath"] for m in c.get("volumeMounts", ())]
    out = list(argv)
    for i, arg in enumerate(argv[:-1]):
        path = argv[i + 1]
        stand_in = tmp_path / path.strip("/").replace("/", "_")
        if arg in ("--model-path", "--tokenizer-path", "--speculative-draft-model-path"):
            assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), (path, mounts)
            stand_in.mkdir(exist_ok=True)
            out[i + 1] = str(stand_in)
        elif arg.endswith("-file"):
            mounted_secret_file(deploy, c, path)
            # 32 characters: what `openssl rand -hex 16` gives (secrets must be >= 16).
            stand_in.write_text("s" * 32 + "\n")
            out[i + 1] = str(stand_in)
    return out


def server_args(deploy: dict[str, Any], tmp_path: Path) -> ServerArgs:
    """The server's ServerArgs from its Deployment's container."""
    c = container(deploy)
    module, argv = module_args(expand(c))
    assert module == "pdserve.launch_server"
    return ServerArgs.from_cli(with_stand_ins(deploy, c, argv, tmp_path))  # raises on any unknown or invalid flag


# ---- (a) schemas -------------------------------------------------------------------------------
def test_manifests_exist():
    names = {str(p.relative_to(K8S)) for p in manifest_files()}
    assert {"namespace.yaml", "router.yaml", "cpu/prefill.yaml", "cpu/decode.yaml", "gpu/prefill.yaml",
            "gpu/decode.yaml", "gpu/models/pvc.yaml", "gpu/models/download-job.yaml"} <= names, names


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
    args = server_args(deploy, tmp_path)
    assert args.disaggregation_mode == role and args.host == "0.0.0.0"
    # Beyond loopback the PD control plane is authenticated; secret and admin key are files
    # of the Secret's volume, never arguments.
    assert args.disaggregation_secret is None and args.admin_api_key is None and "env" not in c
    assert args.disaggregation_secret_file and args.admin_api_key_file
    argv = expand(c)
    secret_file, key_file = (argv[argv.index(f) + 1] for f in ("--disaggregation-secret-file", "--admin-api-key-file"))
    assert mounted_secret_file(deploy, c, secret_file) == ("pdserve-secrets", "pd-secret")
    assert mounted_secret_file(deploy, c, key_file) == ("pdserve-secrets", "admin-api-key")
    assert args.max_queued_requests is not None
    ports = {p["containerPort"] for p in c["ports"]}
    assert args.port in ports
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": args.port}, (probe, c[probe])
        # A busy server answers late: a probe waits seconds (the default: 1) ...
        assert c[probe].get("timeoutSeconds", 1) >= 3, (probe, c[probe])
    # ... and one slow or failed answer does not take it out of the Service, nor restart it
    # (the router stops sending at the first "draining" by itself).
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe].get("failureThreshold", 3) >= 3, (probe, c[probe])
    # The drain: preStop POSTs /drain with the admin key, on the server's port; the key
    # reaches curl on its standard input (-K -), from the file, never as an argument.
    hook = c["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["sh", "-c"], hook
    assert "-X POST" in hook[2] and f"http://127.0.0.1:{args.port}/drain" in hook[2], hook
    assert f"$(cat {key_file})" in hook[2] and "curl -fsS -K -" in hook[2], hook
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
        # GPU nodes' usual taint is tolerated.
        tolerations = deploy["spec"]["template"]["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
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
    cfg = router_config.from_cli(with_stand_ins(deploys["router"], c, argv, tmp_path))  # raises on a bad flag
    assert cfg.pd_disaggregation and cfg.service_discovery and cfg.host == "0.0.0.0"
    assert cfg.service_discovery_namespace == "pdserve"
    for role, selector in (("prefill", cfg.prefill_selector), ("decode", cfg.decode_selector)):
        labels = deploys[role]["spec"]["template"]["metadata"]["labels"]
        assert selector and all(labels.get(k) == v for k, v in selector), (role, selector, labels)
        # The prefill selector must not also pick decode pods, nor the reverse.
        other = deploys["decode" if role == "prefill" else "prefill"]["spec"]["template"]["metadata"]["labels"]
        assert not all(other.get(k) == v for k, v in selector), (role, selector)
        assert server_args(deploys[role], tmp_path).port == cfg.service_discovery_port
    prefill_meta = deploys["prefill"]["spec"]["template"]["metadata"]
    assert cfg.bootstrap_port_annotation in prefill_meta["annotations"]
    # The router and the servers share the admin key (it aborts PD legs with it), a file.
    assert cfg.admin_api_key is not None
    key_file = argv[argv.index("--admin-api-key-file") + 1]
    assert mounted_secret_file(deploys["router"], c, key_file) == ("pdserve-secrets", "admin-api-key")
    assert secret_volumes(deploys["router"])["admin-api-key"]["items"] == [{"key": "admin-api-key",
                                                                             "path": "admin-api-key"}]
    # Ready while a healthy server of each role is there; alive whatever the servers do
    # (GPU servers load their weights for minutes: /health is 503 meanwhile, and a
    # liveness probe on it would restart the router into CrashLoopBackOff).
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": cfg.port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": cfg.port}
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


# ---- the GPU variant's model volume -------------------------------------------------------------
def models_objects() -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objects(*sorted((K8S / "gpu" / "models").glob("*.yaml")))}


def download_call(c: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the Job's snapshot_download(...) call (its `python -c`)."""
    assert c["command"][:2] == ["python", "-c"], c["command"]
    calls = [n for n in ast.walk(ast.parse(c["command"][2])) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "snapshot_download"]
    (call,) = calls
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def test_the_model_volume_is_written_by_the_job_and_read_by_the_servers(tmp_path):
    models = models_objects()
    pvc, job = models["PersistentVolumeClaim"], models["Job"]
    # Writable by the Job (ReadOnlyMany could not be filled), in a mode every storage class
    # offers unless the manifest says otherwise.
    assert pvc["spec"]["accessModes"] in (["ReadWriteOnce"], ["ReadWriteMany"]), pvc["spec"]
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    claims = {v["name"]: v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    (mount,) = [m for m in c["volumeMounts"] if m["name"] in claims]
    assert claims[mount["name"]]["claimName"] == pvc["metadata"]["name"]
    assert not claims[mount["name"]].get("readOnly") and not mount.get("readOnly")
    # It downloads where the servers read: their --model-path on their read-only mount.
    local_dir = download_call(c)["local_dir"]
    for role, deploy in deployments(variant("gpu")).items():
        if role == "router":
            continue
        spec = deploy["spec"]["template"]["spec"]
        server = container(deploy)
        argv = expand(server)
        model = argv[argv.index("--model-path") + 1]
        (vol,) = [v for v in spec["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") ==
                  pvc["metadata"]["name"]]
        assert vol["persistentVolumeClaim"]["readOnly"] is True
        (smount,) = [m for m in server["volumeMounts"] if m["name"] == vol["name"]]
        assert smount["readOnly"] is True
        # The same file in both pods: the paths relative to their mount points agree.
        assert Path(model).relative_to(smount["mountPath"]) == Path(local_dir).relative_to(mount["mountPath"])
    # Job pods are nobody's workers: the router's selectors do not pick them.
    component = job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
    assert component not in ("prefill", "decode")


def test_a_gated_models_token_is_an_optional_file(tmp_path, monkeypatch):
    """The Job reads the Hugging Face token from the pdserve-hf-token Secret, mounted as a
    file that HF_TOKEN_PATH names (huggingface_hub's own variable); without the Secret
    (public models) the pod still starts."""
    import huggingface_hub
    import huggingface_hub.constants

    job = models_objects()["Job"]
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert set(env) == {"HF_TOKEN_PATH"} and "valueFrom" not in env["HF_TOKEN_PATH"]  # no secret value in env
    secret, key = mounted_secret_file(job, c, env["HF_TOKEN_PATH"]["value"])
    assert (secret, key) == ("pdserve-hf-token", "token")
    (volume,) = [v["secret"] for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret]
    assert volume["optional"] is True
    # huggingface_hub reads its token from that file, as the Secret stores it (newline and all).
    token_file = tmp_path / "token"
    token_file.write_text("hf_stand_in_token\n")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(token_file))
    try:
        importlib.reload(huggingface_hub.constants)
        assert huggingface_hub.get_token() == "hf_stand_in_token"
    finally:
        monkeypatch.undo()
        importlib.reload(huggingface_hub.constants)
