"""Router tests: fake workers and the router app served from threads of the test
process (fast), or real servers behind a real router process (test_pd_e2e.py)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import httpx

from pdserve.router.app import create_app
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
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in self.client.get("/metrics").text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

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
