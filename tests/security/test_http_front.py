"""Issue 28, the HTTP front of a server: findings 5, 6, 8, 9 (server part) and 10 replayed
by a hostile client on loopback against real server processes.

- 5: a client's own chat template (Jinja the server would run) is refused unless
  --allow-client-chat-template; when allowed, rendering runs off the event loop, and
  chat_template_kwargs change the prompt (they are not "without effect").
- 6: a body above --max-request-bytes is a 413 before it is parsed (announced or chunked);
  a prompt too long to fit is refused in characters before it is tokenized; headers of
  1-10 MB get a 431 the client can read.
- 8: idle connections, partial headers and headers without their body are closed within
  --request-read-timeout (408 when a request had started).
- 9: with --admin-api-key only its holder aborts, flushes or drains (issue 39: the refusal
  names the flag; without an admin key: tests/security/test_admin_routes.py); an abort for a rid not seen
  yet does not poison a later request (only the admin's waits, briefly, for its request);
  an abort that overtakes a request being prepared is applied.
- 10: keys are compared in constant time.

After every attack the server is healthy and answers a normal request as before.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from pdserve.server import http_front
from pdserve.server.tokenizer_manager import EARLY_ABORT_S
from tests.conftest import GREEDY
from tests.server.conftest import ServerProcess, assert_openai_error
from tests.waiting import wait_until

USER, ADMIN = "user-key-0123456789", "admin-key-0123456789"
READ_TIMEOUT = 2.0       # the guarded server's --request-read-timeout
CLOSE_MARGIN = 5.0       # how much later than READ_TIMEOUT a slow connection may still be closed
NORMAL = {"text": "abc", "sampling_params": dict(GREEDY, max_new_tokens=6)}
LONG = dict(GREEDY, max_new_tokens=900, ignore_eos=True)


def user(key: str = USER) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- servers -------------------------------------------------------------------------------
class Target:
    """A server under attack and what it answered to a normal request before any attack."""

    def __init__(self, server: ServerProcess, headers: dict[str, str]) -> None:
        self.server = server
        self.headers = headers
        self.url = server.url
        self.port = server.port
        self.reference = self.normal()

    def normal(self) -> str:
        r = httpx.post(self.url + "/generate", json=NORMAL, headers=self.headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["text"]

    def assert_serving(self) -> None:
        """Alive, healthy, and a normal request gets the answer it got before the attack."""
        assert self.server.proc.poll() is None, self.server.output()[-4000:]
        assert httpx.get(self.url + "/health", timeout=10).status_code == 200
        assert self.normal() == self.reference
        assert "Exception in ASGI application" not in self.server.output()

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers if headers is None else headers,
                          timeout=kw.pop("timeout", 60), **kw)


@pytest.fixture(scope="module")
def guarded(llama_dir, tmp_path_factory) -> Iterator[Target]:
    """Both keys (the admin key from a file, as a mounted secret gives it, newline and
    all), a short read timeout, client templates refused (the default)."""
    admin_key = tmp_path_factory.mktemp("secrets") / "admin-api-key"
    admin_key.write_text(ADMIN + "\n")
    s = ServerProcess(llama_dir, "--request-read-timeout", str(READ_TIMEOUT), "--admin-api-key-file", str(admin_key),
                      api_key=USER)
    try:
        yield Target(s, user())
    finally:
        s.close()


@pytest.fixture(scope="module")
def open_templates(llama_dir) -> Iterator[Target]:
    """No keys, client chat templates allowed."""
    s = ServerProcess(llama_dir, "--allow-client-chat-template")
    try:
        yield Target(s, {})
    finally:
        s.close()


# ---- raw sockets ---------------------------------------------------------------------------
def until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when that was (seconds
    from the call). AssertionError if it is still open after `limit` seconds."""
    t0 = time.monotonic()
    out = b""
    while True:
        left = limit - (time.monotonic() - t0)
        if left <= 0:
            raise AssertionError(f"connection still open after {limit} s (got {out[:200]!r})")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return out, time.monotonic() - t0


def parse_response(raw: bytes) -> tuple[int, Any]:
    """Status and JSON body of one raw HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), raw[:300]
    return int(head.split()[1]), json.loads(body)


def assert_raw_error(raw: bytes, status: int, *words: str) -> None:
    code, body = parse_response(raw)
    assert code == status, raw[:500]
    err = body["error"]
    assert err["code"] == status and isinstance(err["message"], str), body
    for w in words:
        assert w in err["message"], body


# ---- finding 5: client-supplied Jinja ------------------------------------------------------
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
# Nested loops that render nothing: seconds of CPU in the renderer (finding 5 blocked /health 3.6 s).
SLOW_TEMPLATE = ("{% for a in range(2000) %}{% for b in range(300) %}{% for c in range(100) %}{% endfor %}"
                 "{% endfor %}{% endfor %}{{ messages[0]['content'] }}")


def test_client_chat_template_is_refused_by_default(guarded):
    for body in (dict(CHAT, chat_template_kwargs={"chat_template": "{{ 'x' }}"}),
                 dict(CHAT, chat_template="{{ 'x' }}")):
        err = assert_openai_error(guarded.post("/v1/chat/completions", body),
                                  fields=("chat_template_kwargs", "chat_template"))
        assert "chat_template" in err["message"], err
    # Arguments of the template call are not template variables (tools go at the top level,
    # where they are checked; they must not come in through the kwargs).
    for key, value in (("tools", [{"type": "function"}]), ("add_generation_prompt", False),
                       ("continue_final_message", True), ("tokenize", True)):
        err = assert_openai_error(guarded.post("/v1/chat/completions", dict(CHAT, chat_template_kwargs={key: value})),
                                  fields=("chat_template_kwargs",))
        assert f"chat_template_kwargs.{key}" in err["message"], err
    guarded.assert_serving()


def test_allowed_client_template_changes_results_as_the_prompt_it_renders(open_templates):
    t = open_templates
    completion = t.post("/v1/completions", {"prompt": "zhi", "max_tokens": 4, "temperature": 0}).json()
    chat = t.post("/v1/chat/completions", dict(CHAT, chat_template_kwargs={
        "chat_template": "{{ lead }}{{ messages[0]['content'] }}", "lead": "z"})).json()
    # The template and its variables made the prompt "zhi": same tokens, same greedy answer.
    assert chat["usage"]["prompt_tokens"] == completion["usage"]["prompt_tokens"] == 3, (chat, completion)
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    t.assert_serving()


def test_template_rendering_does_not_block_the_event_loop(open_templates):
    t = open_templates
    result: dict[str, Any] = {}

    def slow() -> None:
        t0 = time.monotonic()
        result["r"] = t.post("/v1/chat/completions", dict(CHAT, chat_template_kwargs={"chat_template": SLOW_TEMPLATE}),
                             timeout=300)
        result["seconds"] = time.monotonic() - t0
    th = threading.Thread(target=slow)
    th.start()
    waits = []
    while th.is_alive():
        t0 = time.monotonic()
        assert httpx.get(t.url + "/health", timeout=300).status_code == 200
        waits.append(time.monotonic() - t0)
        time.sleep(0.05)
    th.join()
    assert result["r"].status_code == 200, result["r"].text
    render = result["seconds"]
    assert render > 0.5, f"the template rendered in {render:.2f} s: too fast to tell"
    # On the event loop, a /health probe would wait for the whole render.
    assert len(waits) >= 3 and max(waits) < render / 3, (render, waits)
    t.assert_serving()


# ---- finding 6: body size, prompt length, header size -------------------------------------
def http_process_rss_mb(server: ServerProcess) -> float:
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_body_above_max_request_bytes_is_413_before_parsing(guarded):
    rss0 = http_process_rss_mb(guarded.server)
    big = b"{" + b"x" * (10 << 20)   # not even JSON: a 413, not a 400, shows it was never parsed
    r = httpx.post(guarded.url + "/generate", content=big, timeout=60,
                   headers=dict(guarded.headers, **{"content-type": "application/json"}))
    err = assert_openai_error(r, 413)
    assert "--max-request-bytes" in err["message"] and err["param"] is None, err

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"text": "'
        for _ in range(100):
            yield b"a" * (100 << 10)
        yield b'"}'
    r = httpx.post(guarded.url + "/generate", content=chunked(), headers=guarded.headers, timeout=60)
    assert "--max-request-bytes" in assert_openai_error(r, 413)["message"]
    # A valid 10 MB prompt too (the original attack): refused, and the HTTP process did not
    # grow by the hundreds of MB tokenizing it took.
    for _ in range(3):
        assert_openai_error(guarded.post("/generate", {"text": "a" * (10 << 20)}), 413)
    assert http_process_rss_mb(guarded.server) - rss0 < 150
    guarded.assert_serving()


@pytest.mark.parametrize("path,body,field_name", [
    ("/generate", {"text": "a" * (4 << 20)}, "text"),
    ("/generate", {"text": ["b", "a" * (4 << 20)]}, "text"),
    ("/v1/completions", {"prompt": "a" * (4 << 20)}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (4 << 20)}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 1000}] * 4000}, "messages"),
])
def test_prompt_too_long_to_fit_is_refused_in_characters(guarded, path, body, field_name):
    # Under the body limit, far over what the context (1024 tokens) could hold: refused
    # before tokenizing, naming the field and the bound.
    err = assert_openai_error(guarded.post(path, body), 400, fields=(field_name,))
    assert err["param"] == field_name and "characters" in err["message"], err
    guarded.assert_serving()


@pytest.mark.parametrize("size", [1 << 20, 10 << 20])
def test_huge_headers_get_431_the_client_can_read(guarded, size):
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * size + b"\r\n\r\n")
        raw, _ = until_closed(s, 30)
    assert_raw_error(raw, 431, "headers")
    r = httpx.get(guarded.url + "/v1/models", headers=dict(guarded.headers, **{"x-pad": "a" * (1 << 20)}), timeout=30)
    assert r.status_code == 431 and r.json()["error"]["code"] == 431, r.text[:300]
    guarded.assert_serving()


# ---- finding 8: slow and idle clients ------------------------------------------------------
SLOW_CLIENTS = {
    "idle": b"",
    "partial headers": b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: appl",
    "headers without the body": (b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + USER.encode()
                                 + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"te"),
    "no body, no key": b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n",
}


@pytest.mark.parametrize("kind", list(SLOW_CLIENTS))
def test_slow_or_idle_connection_is_closed_within_the_read_timeout(guarded, kind):
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        if SLOW_CLIENTS[kind]:
            s.sendall(SLOW_CLIENTS[kind])
        raw, seconds = until_closed(s, READ_TIMEOUT + CLOSE_MARGIN)
    if kind in ("partial headers", "headers without the body"):
        assert_raw_error(raw, 408, "--request-read-timeout")
    elif kind == "idle":
        assert raw == b""
    else:  # answered at once (no key); the body it never sent no longer holds the connection
        assert parse_response(raw)[0] == 401
    guarded.assert_serving()


def test_many_slow_connections_do_not_stall_the_server(guarded):
    socks = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(40)]
    try:
        for i, s in enumerate(socks):
            s.sendall(list(SLOW_CLIENTS.values())[i % len(SLOW_CLIENTS)])
        guarded.assert_serving()  # while they hang
        t0 = time.monotonic()
        for s in socks:
            until_closed(s, max(1.0, READ_TIMEOUT + CLOSE_MARGIN - (time.monotonic() - t0)))
    finally:
        for s in socks:
            s.close()
    guarded.assert_serving()


def test_slow_body_that_arrives_in_time_is_served(guarded):
    body = json.dumps(NORMAL).encode()
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + USER.encode()
                  + b"\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n")
        for part in (body[:10], body[10:]):
            time.sleep(READ_TIMEOUT / 4)
            s.sendall(part)
        raw, _ = until_closed(s, 60)
    status, out = parse_response(raw)
    assert status == 200 and out["text"] == guarded.reference, raw[:500]


# ---- finding 9: admin routes and aborts by rid ---------------------------------------------
def test_admin_routes_need_the_admin_key(guarded):
    for path, body in (("/abort_request", {"rid": "someone-elses"}), ("/flush_cache", None), ("/drain", None)):
        for headers in ({}, user(), user(USER + "x")):
            err = assert_openai_error(guarded.post(path, body, headers=headers), 401)
            assert err["type"] == "authentication_error", err
            assert "--admin-api-key" in err["message"] and "admin route" in err["message"], err  # issue 39
        if path != "/drain":  # (the admin's /drain would end this module's server: test_admin_routes.py)
            assert guarded.post(path, body, headers=user(ADMIN)).status_code == 200
    assert guarded.server.proc.poll() is None  # the user key did not drain it
    # The admin key opens the other routes too; /health needs none.
    assert guarded.post("/generate", NORMAL, headers=user(ADMIN)).json()["text"] == guarded.reference
    assert httpx.get(guarded.url + "/health").status_code == 200
    guarded.assert_serving()


def test_clients_cannot_abort_each_others_requests(guarded):
    result: dict[str, Any] = {}
    th = threading.Thread(target=lambda: result.setdefault(
        "r", guarded.post("/generate", {"text": "x", "rid": "victim-1", "sampling_params": LONG})))
    th.start()
    wait_until(lambda: guarded.server.state()["num_running_reqs"] == 1 or not th.is_alive(), 30)
    for headers in (user(), {}):  # another client, with the API key or without
        assert_openai_error(guarded.post("/abort_request", {"rid": "victim-1"}, headers=headers), 401)
    th.join(60)
    meta = result["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 900, meta
    guarded.assert_serving()


def test_only_the_admins_abort_waits_for_its_request_and_only_briefly(guarded):
    def run(rid: str) -> dict[str, Any]:
        return guarded.post("/generate", {"text": "x", "rid": rid, "sampling_params": LONG}).json()["meta_info"]
    admin = user(ADMIN)
    assert guarded.post("/abort_request", {"rid": "early-1"}, headers=admin).json()["aborted"] is False
    first = run("early-1")   # a router's leg that the abort overtook
    assert first["finish_reason"]["type"] == "abort" and first["completion_tokens"] < 900, first
    # Remembered for that one request only, and not for long.
    assert guarded.post("/generate", dict(NORMAL, rid="early-1")).json()["text"] == guarded.reference
    assert guarded.post("/abort_request", {"rid": "early-2"}, headers=admin).json()["aborted"] is False
    time.sleep(EARLY_ABORT_S + 0.5)
    assert guarded.post("/generate", dict(NORMAL, rid="early-2")).json()["text"] == guarded.reference
    guarded.assert_serving()


def test_abort_for_an_unseen_rid_does_not_poison_a_later_request(open_templates):
    # No admin key: every client may abort, so an abort for a rid nobody sent yet is
    # forgotten; it must not kill the request that uses the rid later.
    t = open_templates
    assert t.post("/abort_request", {"rid": "planted-1"}).json() == {"rid": "planted-1", "aborted": False}
    out = t.post("/generate", dict(NORMAL, rid="planted-1")).json()
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["text"] == t.reference
    t.assert_serving()


def test_abort_that_overtakes_a_request_being_prepared_is_applied(open_templates):
    # The request is in the HTTP process, its template rendering (seconds): it is not live
    # in the scheduler yet, and an abort for it must not be lost.
    t = open_templates
    result: dict[str, Any] = {}
    body = dict(CHAT, rid="prep-1", max_tokens=900, ignore_eos=True,
                chat_template_kwargs={"chat_template": SLOW_TEMPLATE})
    th = threading.Thread(target=lambda: result.setdefault("r", t.post("/v1/chat/completions", body, timeout=300)))
    th.start()
    wait_until(lambda: t.post("/abort_request", {"rid": "prep-1"}).json()["aborted"], 60, step=0.05)
    th.join(300)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "abort" and r.json()["usage"]["completion_tokens"] < 900
    t.assert_serving()


# ---- finding 10: constant-time key comparison ----------------------------------------------
def test_keys_are_compared_in_constant_time(monkeypatch):
    calls = []
    real = http_front.hmac.compare_digest
    monkeypatch.setattr(http_front.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    assert http_front.key_matches(b"Bearer " + USER.encode(), USER)
    for wrong in (b"Bearer " + USER[:-1].encode() + b"x", b"Bearer " + USER[:-1].encode(), b"bearer " + USER.encode(),
                  USER.encode(), b"", "Bearer ü".encode()):
        assert not http_front.key_matches(wrong, USER)
    assert len(calls) == 7   # every comparison went through hmac.compare_digest
    assert not http_front.key_matches(None, USER) and not http_front.key_matches(b"Bearer ", None)


def test_wrong_keys_are_refused_over_http(guarded):
    for headers in ({}, user(USER[:-1]), user(USER + "0"), {"Authorization": USER}, user(ADMIN[:-1])):
        assert assert_openai_error(guarded.post("/generate", NORMAL, headers=headers), 401)["type"] \
            == "authentication_error"
    guarded.assert_serving()
