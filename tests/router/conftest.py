"""Router tests: fake workers and the router app served from threads of the test
process (fast), or real servers behind a real router process (test_pd_e2e.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

from pdserve.router.app import create_app
from pdserve.router.config import from_cli
from pdserve.router.fake_worker import FakeWorker, ThreadedServer
from tests import process_logs
from tests.server.conftest import REPO_ROOT, free_port, metric_value, wait_until_healthy


class FakeDeployment:
    """Fake prefill/decode (or plain) workers behind an in-process router."""

    def __init__(self, router: ThreadedServer, app: Any, prefill: list[tuple[FakeWorker, ThreadedServer]],
                 decode: list[tuple[FakeWorker, ThreadedServer]]) -> None:
        self.router = router
        self.app = app
        self.url = router.url
        self.prefill = [w for w, _ in prefill]
        self.decode = [w for w, _ in decode]
        self.servers = {id(w): s for w, s in prefill + decode}
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def server_of(self, worker: FakeWorker) -> ThreadedServer:
        return self.servers[id(worker)]

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.client.get("/metrics").text, name, **labels)

    def worker_state(self) -> dict[str, bool]:
        info = self.client.get("/get_server_info").json()
        return {w["url"]: w["healthy"] for role in ("prefill", "decode", "plain") for w in info.get(role, [])}


@contextlib.contextmanager
def fake_deployment(prefills: int = 1, decodes: int = 1, *flags: str, plain: bool = False,
                    configure: Callable[[FakeWorker], None] | None = None) -> Iterator[FakeDeployment]:
    with contextlib.ExitStack() as stack:
        def start(role: str) -> tuple[FakeWorker, ThreadedServer]:
            w = FakeWorker(role)
            if configure is not None:
                configure(w)
            return w, stack.enter_context(ThreadedServer(w.app()))
        if plain:
            pre: list = []
            dec = [start("plain") for _ in range(decodes)]
            argv = ["--worker-urls", *(s.url for _, s in dec)]
        else:
            pre = [start("prefill") for _ in range(prefills)]
            dec = [start("decode") for _ in range(decodes)]
            argv = ["--pd-disaggregation"]
            for i, (_, s) in enumerate(pre):
                argv += ["--prefill", s.url, str(9000 + i)]
            for _, s in dec:
                argv += ["--decode", s.url]
        app = create_app(from_cli([*argv, *flags]))
        router = stack.enter_context(ThreadedServer(app))
        dep = FakeDeployment(router, app, pre, dec)
        stack.callback(dep.client.close)
        yield dep


# ---- a real router process ------------------------------------------------------------
class RouterProcess:
    """`python -m pdserve.router ...` on a free port, ready once its /health is 200
    (``log_level`` None: the router's own default)."""

    def __init__(self, *args: str, ready_timeout: float = 60.0, log_level: str | None = "warning") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="pdserve-router-", suffix=".log", delete=False)
        self.argv = [sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(self.port),
                     *(("--log-level", log_level) if log_level else ()), *args]
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        process_logs.register(self.log.name, f"router :{self.port}")
        self.client = httpx.Client(base_url=self.url, timeout=120)
        try:
            wait_until_healthy(self.proc, self.url, ready_timeout, self.output, what="router")
        except AssertionError as exc:
            output = self.output()
            self.close()  # deletes the log
            raise RuntimeError(f"{exc}\n{output}") from None

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.client.get("/metrics").text, name, **labels)

    def worker_health(self) -> dict[str, bool]:
        info = self.client.get("/get_server_info", timeout=10).json()
        return {w["url"]: w["healthy"] for role in ("prefill", "decode", "plain") for w in info.get(role, [])}

    def close(self) -> None:
        stop_process(self.proc)
        self.client.close()
        self.log.close()
        process_logs.unregister(self.log.name)
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, SIGKILL if it is still there after `grace_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
