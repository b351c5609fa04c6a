"""deploy/k8s's preStop hooks, run as the kubelet runs them (`sh -c`, with curl), against a
local HTTP server standing in for the pod's own server: each POSTs /drain with the admin
key read from the mounted secret file (the key never an argument), and the hook exits 0
even when the server is already gone (a failing preStop hook would only delay the kill).
Not in the fast tier: it starts processes."""

from __future__ import annotations

import http.server
import shutil
import subprocess
import threading
from typing import Any, Iterator

import pytest

from tests.deploy.test_k8s import VARIANTS, container, deployments, variant

ADMIN_KEY = "adm-0123456789abcdef"


@pytest.fixture
def drain_target() -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """A server on a free loopback port recording each request's method, path and headers."""
    seen: list[dict[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            seen.append({"path": self.path, "authorization": self.headers.get("Authorization")})
            body = b'{"status": "draining"}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


def hooks() -> list[tuple[str, str, list[str], str]]:
    """(variant, role, preStop command, the secret volume's mount path) of every server."""
    out = []
    for name in VARIANTS:
        for role, deploy in deployments(variant(name)).items():
            if role == "router":
                continue
            c = container(deploy)
            (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "secrets"]
            out.append((name, role, c["lifecycle"]["preStop"]["exec"]["command"], mount))
    return out


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed here (the image installs it)")
@pytest.mark.parametrize("name,role,command,mount", hooks(), ids=[f"{n}-{r}" for n, r, _, _ in hooks()])
def test_prestop_drains_with_the_key_from_the_file(name, role, command, mount, drain_target, tmp_path):
    port, seen = drain_target
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "admin-api-key").write_text(ADMIN_KEY + "\n")  # as a Secret volume holds it
    script = command[2].replace(mount, str(secrets)).replace("127.0.0.1:30000", f"127.0.0.1:{port}")
    assert ADMIN_KEY not in script
    r = subprocess.run(command[:2] + [script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert seen == [{"path": "/drain", "authorization": f"Bearer {ADMIN_KEY}"}]
    # The server already gone: the hook still succeeds (the kubelet then sends SIGTERM).
    gone = script.replace(f"127.0.0.1:{port}", "127.0.0.1:9")
    assert subprocess.run(command[:2] + [gone], capture_output=True, text=True, timeout=30).returncode == 0
