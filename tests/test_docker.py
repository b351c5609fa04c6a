"""docker/compose.yml runs the same CLI the tests run: every service's command parses with
the server's or the router's own argument parser, the wiring between them is consistent
(decode reaches prefill's bootstrap port, the router names both), and the Dockerfile's
default command is a valid server command. (No Docker engine runs here; CI also checks
the file with `docker-compose config`.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from pdserve.config import ServerArgs
from pdserve.router import config as router_config

DOCKER = Path(__file__).resolve().parents[1] / "docker"


def services() -> dict[str, dict]:
    return yaml.safe_load((DOCKER / "compose.yml").read_text())["services"]


def module_args(command: list[str]) -> tuple[str, list[str]]:
    assert command[:2] == ["python", "-m"], command
    return command[2], command[3:]


def test_compose_services_use_the_tested_cli():
    svc = services()
    assert set(svc) == {"prefill", "decode", "router"}
    servers = {}
    for name in ("prefill", "decode"):
        module, argv = module_args(svc[name]["command"])
        assert module == "pdserve.launch_server"
        servers[name] = ServerArgs.from_cli(argv)  # raises on any unknown or invalid flag
        assert servers[name].disaggregation_mode == name and servers[name].host == "0.0.0.0"
        health = " ".join(svc[name]["healthcheck"]["test"])
        assert f"localhost:{servers[name].port}/health" in health
        assert str(servers[name].port) in svc[name]["expose"]
    assert str(servers["prefill"].disaggregation_bootstrap_port) in svc["prefill"]["expose"]
    # Listening on the network, the pair shares one control-plane secret (from the environment).
    assert servers["prefill"].disaggregation_secret == servers["decode"].disaggregation_secret
    assert servers["prefill"].disaggregation_secret.startswith("${PDSERVE_PD_SECRET:?")
    module, argv = module_args(svc["router"]["command"])
    assert module == "pdserve.router"
    cfg = router_config.from_cli(argv)
    (prefill,), (decode,) = cfg.prefill, cfg.decode
    assert urlsplit(prefill.url).hostname == "prefill" and urlsplit(prefill.url).port == servers["prefill"].port
    assert prefill.bootstrap_port == servers["prefill"].disaggregation_bootstrap_port
    assert urlsplit(decode.url).hostname == "decode" and urlsplit(decode.url).port == servers["decode"].port
    assert f"{cfg.port}:{cfg.port}" in svc["router"]["ports"]
    assert set(svc["router"]["depends_on"]) == {"prefill", "decode"}


def test_dockerfile_default_command_is_a_server_command():
    text = (DOCKER / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    module, argv = module_args(cmd)
    assert module == "pdserve.launch_server"
    assert ServerArgs.from_cli(argv).host == "0.0.0.0"
    # The image installs what the servers need: CPU torch first, then the project with Mooncake.
    assert "libibverbs1" in text and "mooncake-transfer-engine-non-cuda" in text
    assert text.index("pip install --no-cache-dir \"torch==") < text.index("pip install --no-cache-dir \".[k8s]\" ")
