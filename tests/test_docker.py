"""docker/compose.yml (CPU, the demo model) and docker/compose.gpu.yml (NVIDIA GPUs, a
model directory) run the same CLI the tests run: every service's command parses with the
server's or the router's own argument parser, the wiring between them is consistent
(decode reaches prefill's bootstrap port, the router names both), secrets are files
(compose `secrets:` at /run/secrets/NAME), never flag values that `ps` and `docker
inspect` show; the GPU file reserves the GPUs, mounts the model read-only, and servers
sharing one GPU split its memory. The Dockerfile's build logic runs here under bash with
apt-get and pip stubbed: a CUDA build gets a C compiler (Triton's launcher), the CUDA
torch and Mooncake's CUDA build. (No Docker engine runs here; `docker-compose config`
validates both files where it is installed, as CI does.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

import pytest
import yaml

from pdserve.config import ServerArgs
from pdserve.router import config as router_config
from pdserve.router.config import RouterConfig

DOCKER = Path(__file__).resolve().parents[1] / "docker"
SECRET_FLAGS = ("--disaggregation-secret", "--admin-api-key", "--api-key")  # values `ps` would show
GPU_ENV = {"PDSERVE_MODEL_DIR": "/srv/models/Qwen3-8B"}
TWO_GPUS = {**GPU_ENV, "PDSERVE_DECODE_GPU": "1", "PDSERVE_MEM_FRACTION": "0.85"}
LONE_SERVER_SHARE = ServerArgs.mem_fraction_static  # what one server takes of its GPU by default


# ---- compose's variable interpolation (the forms the files use) --------------------------------
def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """`${VAR}`, `${VAR:-default}` and `${VAR:?message}` replaced as compose replaces them;
    any other `$` form is refused (the files must stay within these)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == ":-" else ""

    out = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)([^}]*))?\}", one, value)
    assert "$" not in out, f"unsupported interpolation in {value!r}"
    return out


def compose(name: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file as `docker compose` sees it with `env` (merge keys resolved)."""
    return interpolate(yaml.safe_load((DOCKER / name).read_text()), env or {})


def module_args(command: list[str]) -> tuple[str, list[str]]:
    assert command[:2] == ["python", "-m"], command
    return command[2], command[3:]


def with_stand_ins(svc: dict[str, Any], argv: list[str], tmp_path: Path) -> list[str]:
    """`argv` with each container path replaced by a stand-in file or directory here, after
    checking it exists in the container: a secret file must be one of the service's
    secrets (/run/secrets/NAME), the model directory must lie on one of its volumes."""
    mounts = [v.split(":")[1] for v in svc.get("volumes", ())]
    out = list(argv)
    for i, arg in enumerate(argv[:-1]):
        path = argv[i + 1]
        if arg.endswith("-file"):
            name = path.removeprefix("/run/secrets/")
            assert path.startswith("/run/secrets/") and name in svc["secrets"], (arg, path, svc.get("secrets"))
            stand_in = tmp_path / f"secret-{name}"
            stand_in.write_text("s" * 32 + "\n")
            out[i + 1] = str(stand_in)
        elif arg == "--model-path":
            assert path in mounts or any(path.startswith(m.rstrip("/") + "/") for m in mounts), (path, mounts)
            (tmp_path / "model").mkdir(exist_ok=True)
            out[i + 1] = str(tmp_path / "model")
    return out


def parsed(cfg: dict[str, Any], tmp_path: Path) -> tuple[dict[str, ServerArgs], RouterConfig]:
    svc = cfg["services"]
    assert set(svc) == {"prefill", "decode", "router"}
    servers = {}
    for name in ("prefill", "decode"):
        module, argv = module_args(svc[name]["command"])
        assert module == "pdserve.launch_server"
        assert not set(argv) & set(SECRET_FLAGS), argv  # secrets come from files
        servers[name] = ServerArgs.from_cli(with_stand_ins(svc[name], argv, tmp_path))  # raises on a bad flag
    module, argv = module_args(svc["router"]["command"])
    assert module == "pdserve.router" and not set(argv) & set(SECRET_FLAGS), argv
    return servers, router_config.from_cli(with_stand_ins(svc["router"], argv, tmp_path))


def check_wiring(cfg: dict[str, Any], servers: dict[str, ServerArgs], router: RouterConfig) -> None:
    svc = cfg["services"]
    for name, args in servers.items():
        assert args.disaggregation_mode == name and args.host == "0.0.0.0"
        health = " ".join(svc[name]["healthcheck"]["test"])
        assert f"localhost:{args.port}/health" in health
        assert str(args.port) in svc[name]["expose"]
        # Listening on the network: the control plane's secret and the admin key, from files
        # both servers (and the router, for the key) mount.
        assert args.disaggregation_secret_file and args.admin_key() and args.admin_api_key is None
    assert str(servers["prefill"].disaggregation_bootstrap_port) in svc["prefill"]["expose"]
    assert {"pd_secret", "admin_api_key"} <= set(svc["prefill"]["secrets"]) == set(svc["decode"]["secrets"])
    assert "admin_api_key" in svc["router"]["secrets"] and router.admin_api_key
    for name in ("pd_secret", "admin_api_key"):  # file secrets, not environment values
        assert set(cfg["secrets"][name]) == {"file"} and cfg["secrets"][name]["file"].startswith("./secrets/")
    (prefill,), (decode,) = router.prefill, router.decode
    assert urlsplit(prefill.url).hostname == "prefill" and urlsplit(prefill.url).port == servers["prefill"].port
    assert prefill.bootstrap_port == servers["prefill"].disaggregation_bootstrap_port
    assert urlsplit(decode.url).hostname == "decode" and urlsplit(decode.url).port == servers["decode"].port
    assert f"{router.port}:{router.port}" in svc["router"]["ports"]
    assert set(svc["router"]["depends_on"]) == {"prefill", "decode"}
    # SIGTERM drains: docker waits longer than the drain before it kills.
    for name, args in servers.items():
        grace = int(svc[name]["stop_grace_period"].removesuffix("s"))
        assert grace > args.graceful_shutdown_timeout, (name, grace)


# ---- CPU ---------------------------------------------------------------------------------------
def test_compose_services_use_the_tested_cli(tmp_path):
    cfg = compose("compose.yml")
    servers, router = parsed(cfg, tmp_path)
    check_wiring(cfg, servers, router)
    # The demo model, on the CPU image.
    assert all(args.model_path is None for args in servers.values())
    assert {s["image"] for s in cfg["services"].values()} == {"pdserve:cpu"}
    assert cfg["services"]["prefill"]["build"]["args"] == {"DEVICE": "cpu"}


def test_a_secret_flag_value_is_refused_by_the_check(tmp_path):
    """The check above can fail: a secret passed as a flag value is caught."""
    cfg = compose("compose.yml")
    cfg["services"]["decode"]["command"] += ["--admin-api-key", "visible-in-ps-0123"]
    with pytest.raises(AssertionError):
        parsed(cfg, tmp_path)


# ---- GPU ---------------------------------------------------------------------------------------
def gpus(svc: dict[str, Any]) -> list[str]:
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], device
    return device["device_ids"]


def memory_per_gpu(cfg: dict[str, Any], servers: dict[str, ServerArgs]) -> dict[str, float]:
    """The --mem-fraction-static the servers together ask of each GPU."""
    taken: dict[str, float] = {}
    for name, args in servers.items():
        for gpu in gpus(cfg["services"][name]):
            taken[gpu] = taken.get(gpu, 0.0) + args.mem_fraction_static
    return taken


@pytest.mark.parametrize("env,shared", [(GPU_ENV, True), (TWO_GPUS, False)], ids=["one-gpu", "two-gpus"])
def test_gpu_compose_reserves_gpus_mounts_the_model_and_splits_a_shared_gpu(env, shared, tmp_path):
    cfg = compose("compose.gpu.yml", env)
    servers, router = parsed(cfg, tmp_path)
    check_wiring(cfg, servers, router)
    svc = cfg["services"]
    for name, args in servers.items():
        # The model directory, read-only, under the served name clients use.
        assert f"{env['PDSERVE_MODEL_DIR']}:/model:ro" in svc[name]["volumes"] and args.model_path.endswith("model")
        assert args.served_model_name == ("default",)
        assert svc[name]["build"]["args"]["DEVICE"] == "cuda" and svc[name]["image"] == "pdserve:cuda"
        assert svc[name]["shm_size"] == "8gb"
        # Loading the weights may take 15 minutes before the first health check counts.
        assert svc[name]["healthcheck"]["start_period"] == "15m"
    assert "deploy" not in svc["router"] and "volumes" not in svc["router"]  # the router needs neither
    taken = memory_per_gpu(cfg, servers)
    assert len(taken) == (1 if shared else 2), taken
    # Two servers on one GPU each take half of a lone server's share; alone, the whole share.
    assert all(abs(t - LONE_SERVER_SHARE) < 1e-9 for t in taken.values()), taken


def test_gpu_compose_settings_and_the_memory_check_can_fail(tmp_path):
    env = {**GPU_ENV, "PDSERVE_IMAGE": "registry.example/pdserve:1.2-cuda", "PDSERVE_MODEL_NAME": "qwen3-8b",
           "PDSERVE_PREFILL_GPU": "2", "PDSERVE_DECODE_GPU": "3"}
    cfg = compose("compose.gpu.yml", env)
    servers, _ = parsed(cfg, tmp_path)
    assert {s["image"] for s in cfg["services"].values()} == {"registry.example/pdserve:1.2-cuda"}
    assert all(args.served_model_name == ("qwen3-8b",) for args in servers.values())
    assert (gpus(cfg["services"]["prefill"]), gpus(cfg["services"]["decode"])) == (["2"], ["3"])
    # Both servers asking for a lone server's share of one GPU: what the check refuses.
    crowded = compose("compose.gpu.yml", {**GPU_ENV, "PDSERVE_MEM_FRACTION": "0.85"})
    assert memory_per_gpu(crowded, parsed(crowded, tmp_path)[0]) == {"0": pytest.approx(1.7)}
    with pytest.raises(KeyError, match="PDSERVE_MODEL_DIR"):
        compose("compose.gpu.yml", {})


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed (CI installs it)")
def test_docker_compose_accepts_both_files():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    for name, extra in (("compose.yml", {}), ("compose.gpu.yml", GPU_ENV), ("compose.gpu.yml", TWO_GPUS)):
        r = subprocess.run(["docker-compose", "-f", str(DOCKER / name), "config"], capture_output=True, text=True,
                           env={**env, **extra}, timeout=60)
        assert r.returncode == 0, r.stderr
        # What compose itself resolves matches this file's own reading of it.
        assert yaml.safe_load(r.stdout)["services"]["decode"]["command"] == \
            compose(name, extra)["services"]["decode"]["command"]
    r = subprocess.run(["docker-compose", "-f", str(DOCKER / "compose.gpu.yml"), "config", "-q"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0 and "PDSERVE_MODEL_DIR" in r.stderr


# ---- the image ---------------------------------------------------------------------------------
def test_dockerfile_default_command_is_a_server_command():
    text = (DOCKER / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    module, argv = module_args(cmd)
    assert module == "pdserve.launch_server"
    assert ServerArgs.from_cli(argv).host == "0.0.0.0"


def build_steps(device: str | None, torch_index: str | None = None) -> subprocess.CompletedProcess[str]:
    """The Dockerfile's ARGs and RUN steps under bash, apt-get / pip / rm printing what
    they were asked (one line each), for a build with these --build-arg values."""
    lines = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    args = {}
    for line in lines:
        m = re.match(r"^ARG (\w+)(?:=(.*))?$", line)
        if m and m.group(1) != "BASE":
            args[m.group(1)] = (m.group(2) or "").strip('"')
    if device is not None:
        args["DEVICE"] = device
    if torch_index is not None:
        args["TORCH_INDEX"] = torch_index
    stubs = "apt-get() { echo \"apt-get $*\"; }\npip() { echo \"pip $*\"; }\nrm() { :; }\n"
    steps = [line.removeprefix("RUN ") for line in lines if line.startswith("RUN ")]
    script = stubs + "set -e\n" + "".join(f"{k}='{v}'\n" for k, v in args.items()) + "\n".join(steps)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)


def test_dockerfile_builds_cpu_and_cuda_images():
    cpu = build_steps(None)  # the default: the CPU image
    assert cpu.returncode == 0, cpu.stderr
    install = [line for line in cpu.stdout.splitlines() if line.startswith("apt-get install")]
    assert install and "libibverbs1" in install[0] and "gcc" not in install[0]
    pips = [line for line in cpu.stdout.splitlines() if line.startswith("pip ")]
    # torch first, from the CPU index, then the project with Mooncake's non-CUDA build.
    assert pips[0] == "pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert pips[1] == "pip install --no-cache-dir .[k8s] mooncake-transfer-engine-non-cuda"
    cuda = build_steps("cuda")
    assert cuda.returncode == 0, cuda.stderr
    install = [line for line in cuda.stdout.splitlines() if line.startswith("apt-get install")]
    assert "gcc" in install[0].split() and "libc6-dev" in install[0].split()  # Triton's launcher build
    pips = [line for line in cuda.stdout.splitlines() if line.startswith("pip ")]
    assert pips == ["pip install --no-cache-dir torch==2.13.0",  # the default index's (CUDA) build
                    "pip install --no-cache-dir .[k8s] mooncake-transfer-engine"]
    older = build_steps("cuda", "https://wheels.example/cu128")
    assert "pip install --no-cache-dir torch==2.13.0 --index-url https://wheels.example/cu128" in older.stdout
    wrong = build_steps("rocm")
    assert wrong.returncode != 0 and "DEVICE must be cpu or cuda, got 'rocm'" in wrong.stderr
