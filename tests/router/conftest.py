"""Router tests: fake workers and the router app served from threads of the test
process (fast), or real servers behind a real router process (test_pd_e2e.py)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import httpx

from pdserve.router.app import create_app
from tests import process_logs
from pdserve.router.config import from_cli
from pdserve.router.fake_worker import FakeWorker, ThreadedServer


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


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, step: float = 0.02) -> float:
    """Seconds it took for `pred()` to hold."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not reached in {timeout}s")
        time.sleep(step)
    return time.monotonic() - t0


# ---- a real router process ------------------------------------------------------------
class RouterProcess:
    """`python -m pdserve.router ...` on a free port, ready once its /health is 200."""

    def __init__(self, *args: str, ready_timeout: float = 60.0) -> None:
        import os
        import subprocess
        import sys
        import tempfile

        from tests.server.conftest import REPO_ROOT, free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="pdserve-router-", suffix=".log", delete=False)
        self.argv = [sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(self.port),
                     "--log-level", "warning", *args]
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        process_logs.register(self.log.name, f"router :{self.port}")
        self.client = httpx.Client(base_url=self.url, timeout=120)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"router not healthy after {ready_timeout}s:\n{self.output()}")
            time.sleep(0.1)

    def output(self) -> str:
        from pathlib import Path
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.client.get("/metrics").text, name, **labels)

    def worker_health(self) -> dict[str, bool]:
        info = self.client.get("/get_server_info", timeout=10).json()
        return {w["url"]: w["healthy"] for role in ("prefill", "decode", "plain") for w in info.get(role, [])}

    def close(self) -> None:
        import os
        import subprocess
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.client.close()
        self.log.close()
        process_logs.unregister(self.log.name)
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
