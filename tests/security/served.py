"""A server under attack in the security tests, and its answer to a normal request from
before the attack: `assert_serving` checks it is still up, healthy, unchanged, with no
ASGI traceback (and, where asked, its pools full)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.server.conftest import ServerProcess


class Target:
    def __init__(self, server: ServerProcess, normal_body: dict[str, Any], check_pools: bool = False) -> None:
        self.server = server
        self.url = server.url
        self.normal_body = normal_body
        self.check_pools = check_pools
        self.reference = self.normal()

    def normal(self) -> str:
        r = httpx.post(self.url + "/generate", json=self.normal_body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["text"]

    def post(self, path: str, body: Any, timeout: float = 120) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def post_raw(self, path: str, text: str, timeout: float = 120) -> httpx.Response:
        """A body written by hand (one the client's own JSON encoder could not build)."""
        return httpx.post(self.url + path, content=text.encode(), timeout=timeout,
                          headers={"content-type": "application/json"})

    def assert_serving(self) -> None:
        assert self.server.proc.poll() is None, self.server.output()[-4000:]
        assert httpx.get(self.url + "/health", timeout=10).status_code == 200
        assert self.normal() == self.reference
        assert "Exception in ASGI application" not in self.server.output()
        if self.check_pools:
            self.server.assert_pools_full(timeout=60)

    def outcomes(self) -> dict[str, float]:
        """Requests finished so far, by finish reason (the server's metrics)."""
        return {k: self.server.finished(k) for k in ("abort", "length", "stop")}
