"""Issue 28, the router's part: a hostile client on loopback, against a real router
process in front of fake workers (which record what reaches them).

- Finding 7: `n`, `rid`, body size and nesting depth are refused (4xx naming the
  field, never 500) before the router does any per-request work or sends anything.
- Finding 9: with --admin-api-key, only the admin aborts by rid or flushes caches; a
  rid in flight cannot be taken over by another request.
- Finding 10: keys are compared in constant time, the router sends them on to the
  workers, and `pdserve up` starts its servers with the router's keys.

Issue 39 (at the end of the file):
- Finding 10: one canonical form per worker URL (7+ spellings of one server are one
  worker; credentials, URLs over 2048 characters refused), the router's own address refused
  (by spelling, and through a port forward by its own id on /health), a failed add leaves
  nothing registered. Who may reach /workers at all: test_admin_routes.py.
- Finding 11: a worker dribbling its /health holds up no other worker's probes nor keeps a
  recovered worker out; a huge /health body is cut off, the router's memory stays put.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import types
from typing import Any, Iterator
from urllib.parse import quote

import httpx
import psutil
import pytest

import pdserve.server.http_front as http_front
from pdserve.router.fake_worker import FakeWorker, ThreadedServer
from pdserve.up import Deployment, parse_args
from tests.router.conftest import RouterProcess, fake_deployment
from tests.server.conftest import assert_openai_error
from tests.waiting import wait_until

USER, ADMIN = "user-key-0123456789", "admin-key-0123456789"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


class Deployed:
    def __init__(self, router: RouterProcess, prefill: FakeWorker, decode: FakeWorker) -> None:
        self.router, self.prefill, self.decode = router, prefill, decode
        self.client = router.client

    def seen(self) -> int:
        """Requests that reached a worker (generation legs)."""
        return len(self.prefill.requests) + len(self.decode.requests)

    def assert_healthy_and_serving(self, headers: dict[str, str] | None = None) -> None:
        assert self.router.proc.poll() is None, self.router.output()
        assert self.client.get("/health").status_code == 200
        r = self.client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "ab"
        assert "router error" not in self.router.output()  # the handler of unexpected exceptions


@contextlib.contextmanager
def deployed(*flags: str, api_key: str | None = None, admin_api_key: str | None = None) -> Iterator[Deployed]:
    prefill = FakeWorker("prefill", api_key=api_key, admin_api_key=admin_api_key)
    decode = FakeWorker("decode", api_key=api_key, admin_api_key=admin_api_key)
    with ThreadedServer(prefill.app()) as p, ThreadedServer(decode.app()) as d:
        router = RouterProcess("--pd-disaggregation", "--prefill", p.url, "9000", "--decode", d.url, *flags)
        try:
            yield Deployed(router, prefill, decode)
        finally:
            router.close()


@pytest.fixture(scope="module")
def open_router() -> Iterator[Deployed]:
    with deployed() as dep:
        yield dep


@pytest.fixture(scope="module")
def keyed() -> Iterator[Deployed]:
    """Router and workers with the same keys (as `pdserve up --api-key --admin-api-key`)."""
    with deployed("--api-key", USER, "--admin-api-key", ADMIN, "--max-request-bytes", "4096",
                  api_key=USER, admin_api_key=ADMIN) as dep:
        yield dep


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def raw_http(port: int, head: str, body: bytes = b"", timeout: float = 30.0) -> bytes:
    """One request over a raw socket (to send what httpx would not: a Content-Length
    without its body, a chunked body); returns the response's head and as much as came."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + body)
        return recv_head(s, 65536)


def recv_head(sock: socket.socket, bufsize: int) -> bytes:
    """Bytes received until an HTTP head's end (fewer if the peer closes first)."""
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = sock.recv(bufsize)
        if not chunk:
            break
        out += chunk
    return out


# ---- finding 7: validation before any work -------------------------------------------------
def test_huge_n_is_refused_before_any_work(open_router):
    dep = open_router
    seen = dep.seen()
    rss = psutil.Process(dep.router.proc.pid).memory_info().rss
    for route, body in (("/v1/chat/completions", dict(CHAT, n=3_000_000)),
                        ("/v1/completions", dict(COMPLETION, n=3_000_000)),
                        ("/generate", {"text": "hi", "sampling_params": {"n": 3_000_000}})):
        t0 = time.monotonic()
        err = assert_openai_error(dep.client.post(route, json=body), 400, ("n",))
        assert err["param"] == "n" and "--max-n" in err["message"], err
        assert time.monotonic() - t0 < 5.0  # it took 8.2 s (and 421 MB) before the fix
    assert dep.seen() == seen  # no worker saw any of them
    assert psutil.Process(dep.router.proc.pid).memory_info().rss - rss < 100 << 20
    dep.assert_healthy_and_serving()


@pytest.mark.parametrize("n", [True, False, 1.5, 2.0, "2", [2], {"n": 2}, 0, -1, 17])
def test_bad_n_is_a_400_naming_n(open_router, n):
    dep = open_router
    seen = dep.seen()
    for route, body in (("/v1/chat/completions", dict(CHAT, n=n)),
                        ("/v1/completions", dict(COMPLETION, n=n)),
                        ("/generate", {"text": "hi", "sampling_params": {"n": n}}),
                        ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": n}]})):
        err = assert_openai_error(dep.client.post(route, json=body), 400, ("n",))
        assert err["param"] == "n", err
    assert dep.seen() == seen


@pytest.mark.parametrize("rid", [7, 1.5, True, False, {"a": 1}, ["a", 1], [None], [["a"]]])
def test_bad_rid_is_a_400_naming_rid(open_router, rid):
    dep = open_router
    seen = dep.seen()
    for route, body in (("/v1/chat/completions", dict(CHAT, rid=rid)),
                        ("/v1/completions", dict(COMPLETION, rid=rid)),
                        ("/generate", dict(GENERATE, rid=rid)),
                        ("/abort_request", {"rid": rid})):
        err = assert_openai_error(dep.client.post(route, json=body), 400, ("rid",))
        assert err["param"] == "rid", (route, err)
    assert dep.seen() == seen


def test_rid_lists_must_match_the_prompts(open_router):
    dep = open_router
    seen = dep.seen()
    for route, body in (("/v1/chat/completions", dict(CHAT, rid=["a"])),           # chat: one string
                        ("/generate", {"text": ["x", "y"], "rid": ["a"]}),          # one per prompt
                        ("/generate", {"text": ["x", "y"], "rid": "a"}),
                        ("/generate", {"text": ["x", "y"], "rid": ["a", "a"]}),     # distinct
                        ("/v1/completions", {"prompt": ["x", "y"], "rid": ["a", "b", "c"]}),
                        ("/abort_request", {"rid": None}), ("/abort_request", {})):
        err = assert_openai_error(dep.client.post(route, json=body), 400, ("rid",))
        assert err["param"] == "rid", (route, err)
    assert dep.seen() == seen
    # The right shapes pass.
    assert dep.client.post("/generate", json={"text": ["x", "y"], "rid": ["r1", "r2"]}).status_code == 200
    assert dep.client.post("/generate", json=dict(GENERATE, rid=["r3"])).status_code == 200
    assert dep.client.post("/v1/chat/completions", json=dict(CHAT, rid="r4")).status_code == 200


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/generate", "/abort_request"])
@pytest.mark.parametrize("depth", [65, 500, 100_000])
def test_deep_nesting_is_a_400_naming_body(open_router, route, depth):
    """Deeper than the C parser's recursion limit (it was a RecursionError, a 500 on
    /abort_request) and deeper than the router's 64 levels."""
    dep = open_router
    seen = dep.seen()
    raw = b'{"rid": ' + b"[" * depth + b"]" * depth + b"}"
    err = assert_openai_error(dep.client.post(route, content=raw), 400, ("body",))
    assert err["param"] == "body" and "nested" in err["message"], err
    assert dep.seen() == seen


def test_nesting_within_the_limit_and_brackets_in_strings_pass(open_router):
    dep = open_router
    seen = dep.seen()
    deep = {"role": "user", "content": "[" * 5000 + "{" * 5000}  # brackets in a string do not nest
    r = dep.client.post("/v1/chat/completions", json=dict(CHAT, messages=[deep]))
    assert r.status_code == 200, r.text
    nested: Any = "x"
    for _ in range(60):
        nested = [nested]
    r = dep.client.post("/v1/completions", json=dict(COMPLETION, user_metadata=nested))
    assert r.status_code == 200, r.text
    assert dep.seen() == seen + 4


def test_too_many_samples_are_refused_before_any_work(open_router):
    dep = open_router
    seen = dep.seen()
    err = assert_openai_error(dep.client.post("/generate", json={"text": [""] * 40_000, "sampling_params": {"n": 2}}),
                              400, ("text",))
    assert "--max-request-samples" in err["message"], err
    err = assert_openai_error(dep.client.post("/v1/completions", json={"prompt": ["x"] * 70_000}), 400, ("prompt",))
    assert dep.seen() == seen


def test_body_over_the_limit_is_a_413_before_it_is_read(open_router, keyed):
    # Default limit (8 MiB): a Content-Length above it is answered before any byte of the body.
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {(8 << 20) + 1}\r\n\r\n")
    answer = raw_http(open_router.router.port, head)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    # A chunked body is cut off once it passes the limit (4096 on this router).
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {USER}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    payload = b'{"text": "' + b"x" * 5000 + b'"}'
    answer = raw_http(keyed.router.port, head, f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    # The same through httpx, with its OpenAI-shaped body naming the body.
    err = assert_openai_error(keyed.client.post("/abort_request", json={"rid": "x" * 5000}, headers=bearer(ADMIN)),
                              413)
    assert err["param"] == "body" and "--max-request-bytes" in err["message"], err
    open_router.assert_healthy_and_serving()
    keyed.assert_healthy_and_serving(bearer(USER))


def test_no_hostile_body_reached_a_worker_or_broke_the_router(open_router):
    """Every refusal above happened at the router: the workers only saw the requests
    that were meant to pass, and the router still serves."""
    dep = open_router
    bad = {"rid": 1, "n": 0, "bootstrap_room": 3}
    for route in ("/generate", "/v1/completions", "/v1/chat/completions"):
        r = dep.client.post(route, json=bad)
        assert 400 <= r.status_code < 500, r.text
    for body in (b"", b"null", b"[]", b"\xff\xfe", b"{\"rid\": \"\\ud800", b'"' + b"\\u" * 10):
        for route in ("/generate", "/abort_request"):
            r = dep.client.post(route, content=body)
            assert 400 <= r.status_code < 500, (route, body, r.text)
    bodies = [b for _, b in dep.decode.requests]
    assert all(isinstance(b.get("rid"), (str, list)) for b in bodies)
    dep.assert_healthy_and_serving()


# ---- finding 9: aborts and admin routes ----------------------------------------------------
def _hold(dep: Deployed, rid: str, headers: dict[str, str]) -> tuple[threading.Thread, dict]:
    """A request that stays in flight on decode until aborted."""
    dep.decode.faults.hold = True
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=httpx.post(
        dep.router.url + "/generate", json={"text": "x", "rid": rid}, headers=headers, timeout=30)))
    t.start()
    wait_until(lambda: rid in dep.decode.live)
    return t, box


def test_with_an_admin_key_only_the_admin_aborts_or_flushes(keyed):
    dep = keyed
    t, box = _hold(dep, "victim", bearer(USER))
    try:
        for headers in ({}, bearer(USER), bearer(ADMIN + "x"), {"Authorization": ADMIN}):
            assert_openai_error(dep.client.post("/abort_request", json={"rid": "victim"}, headers=headers), 401)
            assert_openai_error(dep.client.post("/flush_cache", headers=headers), 401)
        assert "victim" in dep.decode.live and "victim" not in dep.decode.aborts
        # Another client cannot take the rid over while it is in flight.
        seen = dep.seen()
        err = assert_openai_error(dep.client.post("/generate", json={"text": "y", "rid": "victim"},
                                                  headers=bearer(USER)), 400, ("rid",))
        assert "in flight" in err["message"]
        assert dep.seen() == seen
        r = dep.client.post("/abort_request", json={"rid": "victim"}, headers=bearer(ADMIN))
        assert r.status_code == 200 and r.json() == {"rid": "victim", "aborted": True}
        t.join(30)
        assert box["r"].status_code == 200 and box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        dep.decode.faults.hold = False
        for ev in list(dep.decode.live.values()):
            ev.set()
        t.join(30)
    # The router sent the admin key to the workers' admin routes, the API key elsewhere.
    wait_until(lambda: ("/abort_request", f"Bearer {ADMIN}") in dep.decode.auth)
    assert dep.client.post("/flush_cache", headers=bearer(ADMIN)).status_code == 200
    for w in (dep.prefill, dep.decode):
        assert ("/flush_cache", f"Bearer {ADMIN}") in w.auth
        assert {a for p, a in w.auth if p == "/generate"} == {f"Bearer {USER}"}
        assert all(a != f"Bearer {USER}" for p, a in w.auth if p in ("/abort_request", "/flush_cache"))
    # Worker management (/workers) is an admin route: the API key is not enough.
    assert_openai_error(dep.client.post("/workers", json={"url": "http://127.0.0.1:1", "role": "decode"},
                                        headers=bearer(USER)), 401)
    assert_openai_error(dep.client.get("/workers", headers=bearer(USER)), 401)
    assert_openai_error(dep.client.delete("/workers/http%3A%2F%2F127.0.0.1%3A1", headers=bearer(USER)), 401)
    assert len(dep.client.get("/workers", headers=bearer(ADMIN)).json()["workers"]) == 2
    for path in ("/add_worker", "/remove_worker", "/list_workers"):  # SGLang's names: not routes here
        assert dep.client.post(path, headers=bearer(USER)).status_code in (404, 405)
    dep.assert_healthy_and_serving(bearer(USER))


def test_without_an_admin_key_aborts_stay_open_to_api_clients(open_router):
    """SGLang's behaviour, kept when no admin key is set: any client aborts by rid."""
    dep = open_router
    t, box = _hold(dep, "shared-rid", {})
    try:
        assert_openai_error(dep.client.post("/generate", json={"text": "y", "rid": "shared-rid"}), 400, ("rid",))
        assert dep.client.post("/abort_request", json={"rid": "shared-rid"}).json()["aborted"] is True
        t.join(30)
        assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        dep.decode.faults.hold = False
        t.join(30)
    # Once it is over, the rid is free again.
    assert dep.client.post("/generate", json={"text": "y", "rid": "shared-rid"}).status_code == 200


# ---- finding 10: keys ----------------------------------------------------------------------
def test_keys_are_checked_on_every_route_but_health(keyed):
    dep = keyed
    seen = dep.seen()
    for headers in ({}, bearer(USER[:-1]), bearer(USER + "x"), {"Authorization": f"bearer {USER}"},
                    {"Authorization": USER}):
        assert_openai_error(dep.client.post("/v1/chat/completions", json=CHAT, headers=headers), 401)
        assert_openai_error(dep.client.get("/get_server_info", headers=headers), 401)
    assert dep.seen() == seen
    assert dep.client.get("/health").status_code == 200
    r = dep.client.get("/get_server_info", headers=bearer(USER))
    assert r.status_code == 200 and all(w["healthy"] for w in r.json()["decode"]), r.text
    dep.assert_healthy_and_serving(bearer(USER))
    dep.assert_healthy_and_serving(bearer(ADMIN))  # as on the servers, the admin key opens every route


def test_keys_are_compared_in_constant_time(monkeypatch):
    calls: list[tuple[bytes, bytes]] = []

    def compare_digest(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return a == b
    monkeypatch.setattr(http_front, "hmac", types.SimpleNamespace(compare_digest=compare_digest))  # the router's check
    with fake_deployment(1, 1, "--api-key", USER, "--admin-api-key", ADMIN) as dep:
        assert dep.client.post("/v1/completions", json=COMPLETION, headers=bearer("nope")).status_code == 401
        assert dep.client.post("/v1/completions", json=COMPLETION, headers=bearer(USER)).status_code == 200
        assert dep.client.post("/flush_cache", headers=bearer(USER)).status_code == 401
        assert dep.client.post("/flush_cache", headers=bearer(ADMIN)).status_code == 200
    assert (b"Bearer nope", f"Bearer {USER}".encode()) in calls
    assert (f"Bearer {USER}".encode(), f"Bearer {ADMIN}".encode()) in calls
    assert (f"Bearer {ADMIN}".encode(), f"Bearer {ADMIN}".encode()) in calls


def test_a_router_without_the_workers_keys_gets_their_401():
    """Servers started with keys are closed to a client that only knows the router:
    here the router itself lacks them, and the workers' 401 passes through."""
    w = FakeWorker("plain", api_key=USER)
    with ThreadedServer(w.app()) as s:
        router = RouterProcess("--worker-urls", s.url)
        try:
            assert_openai_error(router.client.post("/v1/completions", json=COMPLETION), 401)
        finally:
            router.close()
        router = RouterProcess("--worker-urls", s.url, "--api-key", USER)
        try:
            r = router.client.post("/v1/completions", json=COMPLETION, headers=bearer(USER))
            assert r.status_code == 200, r.text
        finally:
            router.close()


def test_up_starts_every_server_and_the_router_with_the_keys():
    args = parse_args(["--api-key", USER, "--admin-api-key", ADMIN, "--max-n", "32", "--page-size", "16"])
    dep = Deployment(args, threading.Event())
    for cmd in (dep._server_cmd(1, "prefill", []), dep._server_cmd(2, "decode", []),
                dep._router_cmd([("http://127.0.0.1:1", 3)], ["http://127.0.0.1:2"])):
        joined = " ".join(cmd)
        assert f"--api-key {USER}" in joined and f"--admin-api-key {ADMIN}" in joined, cmd
        assert "--max-n 32" in joined, cmd  # the router applies the servers' limit, not its default
    assert "--page-size" not in " ".join(dep._router_cmd([], []))
    plain = Deployment(parse_args([]), threading.Event())
    assert "--api-key" not in " ".join(plain._server_cmd(1, "prefill", []) + plain._router_cmd([], []))
    # Issue 39: without an admin key, the servers' admin routes answer loopback clients only;
    # a --host from which the router reaches them beyond loopback gets a generated key, the
    # same for every process.
    # (A PD deployment beyond loopback needs its secret: `up` checks the servers' flags first.)
    pd_secret = ["--disaggregation-secret", "s" * 16]
    for host in ("127.0.0.1", "0.0.0.0", "localhost", "::1"):
        args = parse_args(["--host", host, *pd_secret])
        assert args.admin_api_key is None and not args.admin_api_key_generated, host
    args = parse_args(["--host", "192.0.2.2", *pd_secret])
    assert args.admin_api_key_generated and len(args.admin_api_key or "") == 32
    dep = Deployment(args, threading.Event())
    for cmd in (dep._server_cmd(1, "prefill", []), dep._server_cmd(2, "decode", []), dep._router_cmd([], [])):
        assert f"--admin-api-key {args.admin_api_key}" in " ".join(cmd), cmd
    assert parse_args(["--host", "192.0.2.2", "--admin-api-key", ADMIN, *pd_secret]).admin_api_key == ADMIN


@pytest.mark.parametrize("argv, flag", [(["--max-n", "0"], "--max-n"), (["--max-request-bytes", "100"],
                                                                       "--max-request-bytes"),
                                        (["--max-request-samples", "0"], "--max-request-samples")])
def test_limit_flags_name_the_flag(argv, flag):
    from pdserve.router.config import ConfigError, from_cli
    with pytest.raises(ConfigError, match=f"^{flag}:"):
        from_cli(["--worker-urls", "http://127.0.0.1:1", *argv])


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty",
                                  b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"],
                         ids=["idle", "partial-headers", "missing-body"])
def test_slow_or_idle_clients_are_closed_by_the_router(sent):
    """Finding 8 at the router: a connection that does not deliver its request within
    --request-read-timeout is closed (a started request with a 408), and the router serves on."""
    with deployed("--request-read-timeout", "2") as dep:
        with socket.create_connection(("127.0.0.1", dep.router.port), timeout=30) as s:
            s.sendall(sent)
            t0, raw = time.monotonic(), b""
            while chunk := s.recv(65536):
                raw += chunk
            assert time.monotonic() - t0 < 2 + 10  # the deadline, with a wide margin
        if sent:
            assert raw.startswith(b"HTTP/1.1 408"), raw[:200]
        dep.assert_healthy_and_serving()


# ==== issue 39 ==============================================================================
# Finding 10: worker management. Who may reach /workers at all is finding 9
# (test_admin_routes.py); here, what an admin's mistake or a spoofed spelling can do.
def test_worker_urls_have_one_canonical_form():
    from pdserve.router.urls import MAX_URL_CHARS, UrlError, canonical_url
    same = ["http://127.0.0.1:8000", "http://localhost:8000", "http://LOCALHOST.:8000/", "http://0.0.0.0:8000",
            "http://127.1:8000", "http://2130706433:8000", "http://0x7f000001:8000", "http://0x7f.1:8000",
            "http://0177.0.0.1:8000", "http://[::ffff:127.0.0.1]:8000", "HTTP://127.0.0.1:8000"]
    assert {canonical_url(u) for u in same} == {"http://127.0.0.1:8000"}
    assert canonical_url("http://[0:0::1]:8000") == canonical_url("http://[::]:8000") == "http://[::1]:8000"
    assert canonical_url("http://Prefill-0.pdserve.svc:30001") == "http://prefill-0.pdserve.svc:30001"
    assert canonical_url("https://h") == "https://h:443" and canonical_url("http://h") == "http://h:80"
    for bad, why in [("http://user:s3cret@127.0.0.1:8000", "credentials"), ("http://u@h:1", "credentials"),
                     ("http://" + "a" * 100_000 + ":1", str(MAX_URL_CHARS)), ("http://999.0.0.1:1", "IPv4"),
                     ("http://1.2.3.4.5:1", "IPv4"), ("http://08:1", "IPv4"), ("http://a..b:1", "host name"),
                     ("http://h:0", "port"), ("http://h:70000", "port"), ("http://h:1/v1", "base URL"),
                     ("http://h:1?x=1", "base URL"), ("http://h :1", "whitespace"), ("http://hé:1", "non-ASCII"),
                     ("ftp://h:1", "host:port URL"), ("h:1", "host:port URL"), ("http://[fe80::1%25eth0]:1", "zone")]:
        with pytest.raises(UrlError, match=why) as info:
            canonical_url(bad)
        assert "s3cret" not in str(info.value) and len(str(info.value)) < 300, info.value  # never echoed whole


def workers_of(dep: Deployed) -> dict[str, dict]:
    r = dep.client.get("/workers")
    assert r.status_code == 200, r.text
    return {w["url"]: w for w in r.json()["workers"]}


def test_one_server_is_one_worker_however_its_url_is_spelled(open_router):
    """Measured: the same server was accepted under 7 spellings, and the credentials of a
    user:pass@ spelling showed on /metrics."""
    dep = open_router
    before = workers_of(dep)
    decode_url = next(u for u, w in before.items() if w["role"] == "decode")
    port = decode_url.rsplit(":", 1)[1]
    for url in (f"http://0.0.0.0:{port}", f"http://localhost:{port}", f"http://127.1:{port}",
                f"http://2130706433:{port}", f"http://0x7f000001:{port}", f"http://0177.0.0.1:{port}",
                f"http://[::ffff:127.0.0.1]:{port}", f"HTTP://LocalHost.:{port}/"):
        for role in ("decode", "prefill"):
            err = assert_openai_error(dep.client.post("/workers", json={"url": url, "role": role}), 409, ("url",))
            assert decode_url in err["message"] and "already registered" in err["message"], err
        assert dep.client.get("/workers/" + quote(url, safe="")).json()["url"] == decode_url
    for url in (f"http://user:s3cret@127.0.0.1:{port}", f"http://user:s3cret@localhost:{port + '1'}",
                f"http://s3cret@10.0.0.5:{port}"):
        err = assert_openai_error(dep.client.post("/workers", json={"url": url, "role": "decode"}), 400, ("url",))
        assert "credentials" in err["message"] and "s3cret" not in err["message"], err
    assert workers_of(dep).keys() == before.keys()
    assert "s3cret" not in dep.client.get("/metrics").text
    dep.assert_healthy_and_serving()


class PortForward:
    """127.0.0.1:PORT -> 127.0.0.1:target, one thread per direction per connection: the
    router behind an address its own spelling does not give away."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.sock.close()


def test_the_router_is_never_its_own_worker(open_router):
    dep = open_router
    before = workers_of(dep)
    port = dep.router.port
    for url in (f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://0.0.0.0:{port}",
                f"http://127.1:{port}", f"http://2130706433:{port}"):
        err = assert_openai_error(dep.client.post("/workers", json={"url": url, "role": "decode"}), 400, ("url",))
        assert "this router's own address" in err["message"], err
    # An address that does not look like the router's (a port forward, another interface,
    # a DNS name) is recognised by the router's own id on the /health it answers.
    forward = PortForward(port)
    try:
        for role in ("decode", "prefill"):
            r = dep.client.post("/workers", json={"url": forward.url, "role": role})
            err = assert_openai_error(r, 400, ("url",))
            assert "this router itself" in err["message"], err
    finally:
        forward.close()
    assert workers_of(dep).keys() == before.keys()  # nothing left registered
    # On the command line too.
    from pdserve.router.config import ConfigError, from_cli
    for argv in (["--worker-urls", "http://localhost:30000"], ["--worker-urls", "http://127.0.0.1:8000", "--port",
                                                                "8000"],
                 ["--worker-urls", "http://127.1:8000", "--host", "0.0.0.0", "--port", "8000"]):
        with pytest.raises(ConfigError, match="own address"):
            from_cli(argv)
    assert from_cli(["--worker-urls", "http://10.0.0.5:30000"]).workers[0].url == "http://10.0.0.5:30000"
    dep.assert_healthy_and_serving()


def test_a_huge_url_is_a_400_and_nothing_stays_registered():
    """Measured: a 100 KB URL answered 500, stayed registered, and the health loop logged a
    traceback every second."""
    extra = FakeWorker("decode")
    extra.faults.healthy = False
    with ThreadedServer(extra.app()) as late, deployed("--health-check-interval", "0.2") as dep:
        before = workers_of(dep)
        for url in ("http://" + "a" * 100_000 + ":1", "http://127.0.0.1:1/" + "x" * 3000,
                    "http://" + "a" * 300 + ":1"):
            err = assert_openai_error(dep.client.post("/workers", json={"url": url, "role": "decode"}), 400,
                                      ("url",))
            assert len(err["message"]) < 400, err  # the URL is not echoed whole
        assert "2048" in assert_openai_error(dep.client.post("/workers", json={
            "url": "http://" + "a" * 100_000 + ":1", "role": "decode"}), 400)["message"]
        for method in ("GET", "DELETE"):
            r = dep.client.request(method, "/workers/" + quote("http://" + "a" * 10_000 + ":1", safe=""))
            assert_openai_error(r, 400, ("url",))
        assert workers_of(dep).keys() == before.keys()
        # The health loop goes on: a worker added now enters rotation once healthy.
        assert dep.client.post("/workers", json={"url": late.url, "role": "decode"}).status_code == 201
        extra.faults.healthy = True
        wait_until(lambda: workers_of(dep)[late.url]["in_rotation"])
        out = dep.router.output()
        assert "Traceback" not in out and "router error" not in out, out


def test_a_failed_add_leaves_nothing_registered(monkeypatch):
    """Whatever fails while a worker is being added (here its first probe, made to raise),
    the worker is not left behind: the same add succeeds afterwards."""
    w = FakeWorker("decode")
    with ThreadedServer(w.app()) as s, fake_deployment(1, 1) as dep:
        registry = dep.app.state.router.registry

        async def broken(worker: Any) -> bool:
            raise RuntimeError("a bug in the probe")
        monkeypatch.setattr(registry, "probe", broken)
        err = assert_openai_error(dep.client.post("/workers", json={"url": s.url, "role": "decode"}), 500)
        assert "router error" in err["message"]
        monkeypatch.undo()
        assert s.url not in {x["url"] for x in dep.client.get("/workers").json()["workers"]}
        assert dep.client.post("/workers", json={"url": s.url, "role": "decode"}).status_code == 201


# Finding 11: the health loop. Raw TCP "workers" that answer /health badly.
class RawWorker:
    """A TCP server that reads each connection's request head and hands the socket to
    `answer(sock, stop)`; counts connections and the bytes `answer` managed to send."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.stop = threading.Event()
        self.connections = 0
        self.sent: list[int] = []  # per finished connection
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            if b"\r\n\r\n" not in recv_head(conn, 4096):
                return  # the client left before its request's head ended
            self.sent.append(self.answer(conn, self.stop))

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def dribble(conn: socket.socket, stop: threading.Event) -> int:
    """A 200 whose body comes one byte every 0.5 s: each read is well within any per-read timeout."""
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")  # 1000 bytes: 8 minutes
    sent = 0
    try:
        while not stop.wait(0.5):
            conn.sendall(b"x")
            sent += 1
    except OSError:
        pass
    return sent


def endless(announce: bool) -> Any:
    """A 200 whose body is 300 MB, sent as fast as the router reads it (announced with
    Content-Length, or chunked with no length)."""
    def answer(conn: socket.socket, stop: threading.Event) -> int:
        total, block = 300 << 20, b"x" * (1 << 20)
        head = f"content-length: {total}" if announce else "transfer-encoding: chunked"
        conn.sendall(f"HTTP/1.1 200 OK\r\n{head}\r\n\r\n".encode())
        sent = 0
        try:
            while sent < total and not stop.is_set():
                conn.sendall(block if announce else b"%x\r\n%s\r\n" % (len(block), block))
                sent += len(block)
        except OSError:
            pass
        return sent
    return answer


def test_a_dribbling_worker_holds_up_no_other_workers_probes():
    """Measured: a worker dribbling /health stopped every probe, and a real worker taken out
    after one connection error never came back (29 of 29 requests got 503 over 30 s)."""
    slow = RawWorker(dribble)
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    try:
        with ThreadedServer(prefill.app()) as p:
            d = ThreadedServer(decode.app()).start()
            router = RouterProcess("--pd-disaggregation", "--prefill", p.url, "--decode", d.url, "--decode",
                                   slow.url, "--health-check-interval", "0.3", "--health-check-timeout", "1")
            dep = Deployed(router, prefill, decode)
            try:
                slow_state = wait_until(lambda: (lambda w: w if "within 1 s" in (w["last_error"] or "") else None)(
                    workers_of(dep)[slow.url]))
                assert slow_state["state"] == "unhealthy" and "--health-check-timeout" in slow_state["last_error"]
                # The real decode's probes go on: its failures and recovery are seen at once.
                decode.faults.healthy = False
                wait_until(lambda: workers_of(dep)[d.url]["state"] == "unhealthy", 5)
                decode.faults.healthy = True
                wait_until(lambda: workers_of(dep)[d.url]["state"] == "healthy", 5)
                # Taken out by a connection error, then back once it answers again.
                port = d.port
                d.stop()
                # The leg fails to connect (502 once the retry finds no other decode in rotation).
                assert dep.client.post("/v1/chat/completions", json=CHAT).status_code in (502, 503)
                wait_until(lambda: workers_of(dep)[d.url]["state"] == "unhealthy", 5)
                d = ThreadedServer(decode.app(), port=port).start()
                wait_until(lambda: workers_of(dep)[d.url]["in_rotation"], 5)
                for _ in range(3):
                    r = dep.client.post("/v1/chat/completions", json=CHAT)
                    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ab", r.text
                # The slow worker is probed all along, each probe cut off at its deadline.
                seen = slow.connections
                wait_until(lambda: slow.connections >= seen + 2, 10)
                assert workers_of(dep)[slow.url]["in_rotation"] is False
                out = router.output()
                assert "Traceback" not in out and out.count(slow.url) <= 2, out  # no log line per probe
            finally:
                router.close()
                d.stop()
    finally:
        slow.close()


@pytest.mark.parametrize("announce", [True, False], ids=["content-length", "chunked"])
def test_a_huge_health_body_is_cut_off_and_the_worker_counted_unhealthy(announce):
    """Measured: a 300 MB /health body took the router from 79 MB to 1.7 GB."""
    huge = RawWorker(endless(announce))
    try:
        with deployed("--health-check-interval", "0.3") as dep:
            rss = psutil.Process(dep.router.proc.pid).memory_info().rss
            r = dep.client.post("/workers", json={"url": huge.url, "role": "decode"})
            assert r.status_code == 201 and r.json()["state"] == "unhealthy", r.text
            assert "too large" in r.json()["last_error"], r.json()
            wait_until(lambda: len(huge.sent) >= 5, 30)  # five probes, each cut off
            me = workers_of(dep)[huge.url]
            assert me["state"] == "unhealthy" and "65536" in me["last_error"], me
            assert dep.router.metric("pdserve_router:health_check_failures_total", worker=huge.url) >= 5
            # Each probe stopped reading early (what was sent sat in socket buffers), and the
            # router's memory stayed where it was (generous: 1.6 GB more before the fix).
            assert max(huge.sent) < 64 << 20, huge.sent
            assert psutil.Process(dep.router.proc.pid).memory_info().rss - rss < 100 << 20
            dep.assert_healthy_and_serving()
    finally:
        huge.close()
