"""Issue 39, finding 9: admin routes need the admin key; without one, only loopback clients.

The admin routes: a server's /drain, /abort_request and /flush_cache; the router's
/abort_request, /flush_cache and /workers (/workers/{url} too). With --admin-api-key they
need that key (401 naming it; the API key is not enough); without one they answer only
loopback clients (403 to any other, naming --admin-api-key), which still need the API key
when one is set.

Replayed against real processes: a server and a router bound to 0.0.0.0, reached through
this machine's non-loopback address (a non-loopback client) and through 127.0.0.1. Where
the machine has no such address, those tests are skipped and the middleware's rule is
still checked at the ASGI level, with the client address set in the scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, Iterator
from urllib.parse import quote

import httpx
import psutil
import pytest

from pdserve.router.app import ADMIN_PREFIXES, ADMIN_ROUTES
from pdserve.router.fake_worker import FakeWorker, ThreadedServer
from pdserve.server.http_front import ADMIN_PATHS, KeyCheck
from tests.conftest import GREEDY
from tests.router.conftest import RouterProcess
from tests.server.conftest import ServerProcess, assert_openai_error
from tests.waiting import wait_until

USER, ADMIN = "user-key-0123456789", "admin-key-0123456789"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
NORMAL = {"text": "abc", "sampling_params": dict(GREEDY, max_new_tokens=4)}
LOOPBACK = ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1")
ELSEWHERE = ("192.0.2.7", "10.1.2.3", "fd00::2", "::ffff:10.1.2.3")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def non_loopback_ip() -> str | None:
    """An IPv4 address of this machine that is not loopback: connecting to it from here
    makes the connection's peer address that address, so the server sees a non-loopback
    client."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


REMOTE_IP = non_loopback_ip()
needs_remote = pytest.mark.skipif(REMOTE_IP is None, reason="this machine has no non-loopback IPv4 address "
                                  "(the ASGI-level test covers the rule)")


def assert_admin_refused(r: httpx.Response, status: int) -> dict:
    """401 (admin key set, not given) or 403 (no admin key, not loopback), naming the flag."""
    err = assert_openai_error(r, status)
    assert "--admin-api-key" in err["message"] and "admin route" in err["message"], err
    assert err["type"] == ("authentication_error" if status == 401 else "permission_error"), err
    return err


# ---- the middleware, at the ASGI level ------------------------------------------------------
def asgi_call(check: KeyCheck, path: str, client: tuple[str, int] | None, key: str | None) -> tuple[int, str]:
    """One request through `check` in front of an app answering 200: (status, body)."""
    scope: dict[str, Any] = {"type": "http", "path": path, "method": "POST", "client": client,
                             "headers": [(b"authorization", f"Bearer {key}".encode())] if key else []}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"reached"})
    check.app = app
    asyncio.run(check(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]).decode()


SERVER_ADMIN = sorted(ADMIN_PATHS)
ROUTER_ADMIN = [*ADMIN_ROUTES, "/workers/" + quote("http://10.0.0.5:30000", safe="")]


@pytest.mark.parametrize("side", ["server", "router"])
def test_the_admin_rule_at_the_asgi_level(side):
    def check(api_key: str | None, admin_api_key: str | None) -> KeyCheck:
        if side == "server":
            return KeyCheck(None, api_key, admin_api_key)  # type: ignore[arg-type]
        return KeyCheck(None, api_key, admin_api_key, admin_paths=ADMIN_ROUTES,  # type: ignore[arg-type]
                        admin_prefixes=ADMIN_PREFIXES)
    paths = SERVER_ADMIN if side == "server" else ROUTER_ADMIN
    assert {"/drain", "/abort_request", "/flush_cache"} <= set(ADMIN_PATHS)
    for path in paths:
        # No keys: loopback only. A client with no peer address (not TCP) is no loopback client.
        for host in LOOPBACK:
            assert asgi_call(check(None, None), path, (host, 5000), None) == (200, "reached"), (path, host)
        for client in [(h, 5000) for h in ELSEWHERE] + [None, ("testclient", 5000)]:
            status, body = asgi_call(check(None, None), path, client, None)
            assert status == 403 and "--admin-api-key" in body and "loopback" in body, (path, client, body)
        # --api-key only: the user key does not open admin routes from elsewhere; from
        # loopback the API key is still needed.
        for host in ELSEWHERE:
            status, body = asgi_call(check(USER, None), path, (host, 5000), USER)
            assert status == 403 and "--admin-api-key" in body, (path, host, body)
        assert asgi_call(check(USER, None), path, ("127.0.0.1", 5000), USER)[0] == 200
        status, body = asgi_call(check(USER, None), path, ("127.0.0.1", 5000), None)
        assert status == 401 and "API key" in body
        # --admin-api-key: the admin key from anywhere, nothing else from anywhere.
        for host in LOOPBACK[:1] + ELSEWHERE[:1]:
            for key in (None, USER, ADMIN + "x"):
                status, body = asgi_call(check(USER, ADMIN), path, (host, 5000), key)
                assert status == 401 and "--admin-api-key" in body, (path, host, key, body)
            assert asgi_call(check(USER, ADMIN), path, (host, 5000), ADMIN)[0] == 200
            assert asgi_call(check(None, ADMIN), path, (host, 5000), ADMIN)[0] == 200
    # Other routes are not admin routes: open to any address (with the API key if set).
    for host in ELSEWHERE:
        assert asgi_call(check(None, None), "/v1/chat/completions", (host, 5000), None)[0] == 200
        assert asgi_call(check(USER, None), "/generate", (host, 5000), USER)[0] == 200
        assert asgi_call(check(USER, None), "/health", (host, 5000), None)[0] == 200


# ---- a real server -------------------------------------------------------------------------
@contextlib.contextmanager
def server_on_all_interfaces(llama_dir: Any, api_key: str | None) -> Iterator[ServerProcess]:
    s = ServerProcess(llama_dir, "--host", "0.0.0.0", api_key=api_key)
    try:
        yield s
    finally:
        s.close()


@needs_remote
@pytest.mark.parametrize("api_key", [None, USER], ids=["no-keys", "api-key-only"])
def test_a_server_without_an_admin_key_answers_admin_routes_to_loopback_only(llama_dir, api_key):
    """Finding 9 as measured: with --api-key and no --admin-api-key, POST /drain with the
    user key from another machine shut the server down; with no keys, anyone could."""
    headers = bearer(api_key) if api_key else {}
    with server_on_all_interfaces(llama_dir, api_key) as s:
        remote = httpx.Client(base_url=f"http://{REMOTE_IP}:{s.port}", headers=headers, timeout=60)
        local = httpx.Client(base_url=s.url, timeout=60)
        try:
            reference = remote.post("/generate", json=NORMAL)  # the address works: not an admin route
            assert reference.status_code == 200, reference.text
            for path, body in (("/drain", None), ("/abort_request", {"rid": "someone-elses"}), ("/flush_cache", None)):
                assert_admin_refused(remote.post(path, json=body), 403)
            assert s.proc.poll() is None, "the server exited"
            assert httpx.get(s.url + "/health", timeout=10).status_code == 200  # not draining
            assert remote.post("/generate", json=NORMAL).json()["text"] == reference.json()["text"]
            # Loopback: the operator's own machine (a preStop hook, `curl` on the host).
            if api_key:
                assert_openai_error(local.post("/flush_cache"), 401)  # still needs the API key
            assert local.post("/flush_cache", headers=headers).status_code == 200
            assert local.post("/abort_request", json={"rid": "x"}, headers=headers).status_code == 200
            r = local.post("/drain", headers=headers)
            assert r.status_code == 200 and r.json()["status"] == "draining", r.text
            s.proc.wait(60)  # and the drain ends the process, as it should from loopback
            assert s.proc.returncode == 0, s.output()[-3000:]
        finally:
            remote.close()
            local.close()


# ---- a real router -------------------------------------------------------------------------
@contextlib.contextmanager
def router_on_all_interfaces(*flags: str) -> Iterator[RouterProcess]:
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    with ThreadedServer(prefill.app()) as p, ThreadedServer(decode.app()) as d:
        router = RouterProcess("--pd-disaggregation", "--prefill", p.url, "9000", "--decode", d.url,
                               "--host", "0.0.0.0", *flags)
        try:
            yield router
        finally:
            router.close()


def router_admin_requests(client: httpx.Client, headers: dict[str, str]) -> list[httpx.Response]:
    """One request on each of the router's admin routes."""
    some = "/workers/" + quote("http://127.0.0.1:9", safe="")
    return [client.get("/workers", headers=headers),
            client.post("/workers", json={"url": "http://127.0.0.1:9", "role": "decode"}, headers=headers),
            client.get(some, headers=headers), client.delete(some, headers=headers),
            client.post("/abort_request", json={"rid": "x"}, headers=headers),
            client.post("/flush_cache", headers=headers)]


def worker_urls(router: RouterProcess, headers: dict[str, str]) -> list[str]:
    r = router.client.get("/workers", headers=headers)
    assert r.status_code == 200, r.text
    return sorted(w["url"] for w in r.json()["workers"])


@needs_remote
@pytest.mark.parametrize("api_key", [None, USER], ids=["no-keys", "api-key-only"])
def test_a_router_without_an_admin_key_answers_admin_routes_to_loopback_only(api_key):
    """Finding 10's first step: a client with the API key (or anyone, without keys)
    registered its own worker and received other clients' prompts and the router's key."""
    headers = bearer(api_key) if api_key else {}
    with router_on_all_interfaces(*(("--api-key", api_key) if api_key else ())) as router:
        before = worker_urls(router, headers)  # loopback: allowed
        with httpx.Client(base_url=f"http://{REMOTE_IP}:{router.port}", timeout=30) as remote:
            r = remote.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 200, r.text  # the address works for the client routes
            for r in router_admin_requests(remote, headers):
                assert_admin_refused(r, 403)
        assert worker_urls(router, headers) == before  # nothing added, nothing removed
        if api_key:
            for r in router_admin_requests(router.client, {}):
                assert_openai_error(r, 401)  # loopback still needs the API key
        assert router.client.post("/flush_cache", headers=headers).status_code == 200
        assert "router error" not in router.output() and "Traceback" not in router.output()


@pytest.mark.parametrize("given", ["flag", "file"])
def test_a_router_with_an_admin_key_refuses_the_user_key_on_every_admin_route(given, tmp_path):
    admin = ("--admin-api-key", ADMIN)
    if given == "file":  # a mounted secret: off the command line, its trailing newline not part of it
        (tmp_path / "admin-api-key").write_text(ADMIN + "\n")
        admin = ("--admin-api-key-file", str(tmp_path / "admin-api-key"))
    with router_on_all_interfaces("--api-key", USER, *admin) as router:
        bases = [router.url] + ([f"http://{REMOTE_IP}:{router.port}"] if REMOTE_IP else [])
        before = worker_urls(router, bearer(ADMIN))
        for base in bases:
            with httpx.Client(base_url=base, timeout=30) as c:
                for headers in ({}, bearer(USER), bearer(ADMIN + "x")):
                    for r in router_admin_requests(c, headers):
                        assert_admin_refused(r, 401)
                assert c.get("/workers", headers=bearer(ADMIN)).status_code == 200
                assert c.post("/v1/chat/completions", json=CHAT, headers=bearer(USER)).status_code == 200
        assert worker_urls(router, bearer(ADMIN)) == before
        wait_until(lambda: router.client.get("/health").status_code == 200)
