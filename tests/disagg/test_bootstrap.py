"""The bootstrap registry: ranks register, decode lists them once all are there, bad
registrations are refused, only the server's own ranks (holding its registry key) can
register, with a deployment secret only its holders can list, malformed or stalled
requests get a 4xx or are dropped within seconds, an absent server is a timely error."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from pdserve.disagg import protocol as P
from pdserve.disagg.bootstrap import (AUTH_HEADER, REGISTRY_RECIPIENT, BootstrapError, BootstrapServer, fetch_ranks,
                                      register_rank)
from pdserve.disagg.layout import PROTOCOL_VERSION, BufferSpec, CompatRecord, KVLayout

COMPAT = CompatRecord(PROTOCOL_VERSION, "LlamaForCausalLM", 4, 4, 32, "float32", 1, 104)


def rank(i: int, size: int = 2) -> P.RankInfo:
    return P.RankInfo(i, size, "127.0.0.1", 7000 + i, f"127.0.0.1:{16000 + i}", COMPAT,
                      KVLayout(1, (BufferSpec("target.L0.K", 4096 * (i + 1), 100, 256),)))


REGISTRY = P.Authenticator(b"k" * 32, "prefill-rank0")     # the server's own ranks' key
SECRET = b"deployment-secret"


@pytest.fixture
def server():
    s = BootstrapServer("127.0.0.1", 0, REGISTRY)
    yield s
    s.close()


def put(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/ranks", data=data, method="PUT", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def healthy(url: str) -> bool:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return r.status == 200


@pytest.mark.fast
def test_ranks_listed_once_all_registered(server):
    url = f"http://127.0.0.1:{server.port}"
    register_rank(url, rank(1), REGISTRY)
    with pytest.raises(BootstrapError, match="not all prefill ranks registered"):
        fetch_ranks(url, deadline_s=0.3)
    with pytest.raises(urllib.error.HTTPError) as err:  # the registry itself says how many
        urllib.request.urlopen(url + "/ranks", timeout=5)
    assert err.value.code == 503 and "1 of 2" in json.loads(err.value.read())["error"]
    register_rank(url, rank(0), REGISTRY)
    assert fetch_ranks(url, deadline_s=1) == [rank(0), rank(1)]


@pytest.mark.fast
def test_bad_registrations_are_refused(server):
    url = f"http://127.0.0.1:{server.port}"
    register_rank(url, rank(0, 2), REGISTRY)
    with pytest.raises(BootstrapError, match="tp_size"):
        register_rank(url, rank(1, 4), REGISTRY)
    with pytest.raises(BootstrapError, match="tp_rank 3"):
        register_rank(url, rank(3, 2), REGISTRY)
    status, body = put(url, P.encode(P.Abort(1, "x"), REGISTRY, to=REGISTRY_RECIPIENT))
    assert status == 400 and "expected RankInfo" in body["error"]
    status, body = put(url, b'{"v": %d, "type": "Abort", "body": {}}' % PROTOCOL_VERSION,
                       {"Content-Type": "application/json"})
    assert status == 403 and "own ranks" in body["error"]
    assert healthy(url)


@pytest.mark.fast
def test_only_the_servers_own_ranks_can_register(server):
    """Anyone else's registration (unsigned, another key, a replay of a real one) is
    refused: new decode connections can never be sent to an attacker's address."""
    url = f"http://127.0.0.1:{server.port}"
    real = P.encode(rank(0, 1), REGISTRY, to=REGISTRY_RECIPIENT)
    assert put(url, real)[0] == 200
    evil = P.RankInfo(0, 1, "10.6.6.6", 7000, "10.6.6.6:1", COMPAT, rank(0, 1).layout)
    for data in (P.encode(evil), P.encode(evil, P.Authenticator(b"x" * 32, "prefill-rank0"), to=REGISTRY_RECIPIENT),
                 real):
        status, body = put(url, data)
        assert status == 403, body
    assert fetch_ranks(url, deadline_s=1) == [rank(0, 1)]
    assert server.refused == 3


@pytest.mark.fast
def test_with_a_deployment_secret_only_its_holders_can_list_the_ranks():
    """The listing names transfer sessions and buffer addresses: with a secret it needs a
    request signed with it (a decode server of the deployment)."""
    s = BootstrapServer("127.0.0.1", 0, REGISTRY, P.Authenticator(SECRET, "bootstrap"))
    try:
        url = f"http://127.0.0.1:{s.port}"
        register_rank(url, rank(0, 1), REGISTRY)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "/ranks", timeout=5)
        assert err.value.code == 401 and "--disaggregation-secret" in json.loads(err.value.read())["error"]
        with pytest.raises(BootstrapError, match="HTTP 401"):
            fetch_ranks(url, deadline_s=1, auth=P.Authenticator(b"another-secret-x", "decode-rank0"))
        assert fetch_ranks(url, deadline_s=1, auth=P.Authenticator(SECRET, "decode-rank0")) == [rank(0, 1)]
    finally:
        s.close()


@pytest.mark.fast
def test_a_listing_request_signed_for_one_server_is_refused_by_another():
    """Two prefill servers of one deployment (same secret): a listing request names the
    server it is for (its identity from GET /health), so one captured on its way to A
    is refused by B (and by A once used); a registration is bound to the registry."""
    a, b = (BootstrapServer("127.0.0.1", 0, REGISTRY, P.Authenticator(SECRET, "bootstrap")) for _ in range(2))
    try:
        urls = [f"http://127.0.0.1:{s.port}" for s in (a, b)]
        for url in urls:
            register_rank(url, rank(0, 1), REGISTRY)
        ids = []
        for url in urls:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                ids.append(json.loads(r.read())["id"])
        assert ids[0] != ids[1]
        decode = P.Authenticator(SECRET, "decode-rank0")
        for_a = P.encode(P.Heartbeat("decode-rank0"), decode, to=ids[0]).decode()

        def listing(url: str, header: str) -> int:
            req = urllib.request.Request(url + "/ranks", headers={AUTH_HEADER: header})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    return r.status
            except urllib.error.HTTPError as err:
                return err.code
        assert listing(urls[1], for_a) == 401          # captured, sent to B
        assert listing(urls[0], for_a) == 200          # A's own
        assert listing(urls[0], for_a) == 401          # replayed to A
        assert b.refused == 1 and a.refused == 1
        # A control-link message (addressed to a control address) does not list either.
        assert listing(urls[0], P.encode(P.Heartbeat("x"), decode, to="tcp://127.0.0.1:1").decode()) == 401
        assert fetch_ranks(urls[1], deadline_s=1, auth=decode) == [rank(0, 1)]
        # A registration addressed to anything but the registry is refused.
        status, _ = put(urls[0], P.encode(rank(0, 1), REGISTRY, to=ids[0]))
        assert status == 403
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("raw", [
    b"PUT /ranks HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    b"PUT /ranks HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n",
    b"PUT /ranks HTTP/1.1\r\nContent-Length: 200000\r\n\r\n" + b"[" * 200000,
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40),   # a TLS client hello
    b"PUT /ranks HTTP/1.1\r\nContent-Le",                                  # headers that never end
    b"PUT /ranks HTTP/1.1\r\nContent-Length: 100\r\n\r\n{",             # a body that never comes
], ids=["negative-length", "huge-length", "deep-nesting", "tls-hello", "partial-headers", "missing-body"])
def test_malformed_or_stalled_requests_get_a_4xx_or_are_dropped(server, raw):
    url = f"http://127.0.0.1:{server.port}"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(raw)
        t0 = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            answer += chunk
        assert time.monotonic() - t0 < 20  # the client timeout is 5 s; never indefinitely
    if answer:
        status = int(answer.split(b" ", 2)[1])
        assert 400 <= status < 500, answer[:200]
    assert healthy(url)


@pytest.mark.fast
def test_unreachable_bootstrap_fails_within_deadline():
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match="did not list"):
        fetch_ranks("http://127.0.0.1:1", deadline_s=0.5)
    assert time.monotonic() - t0 < 5
    with pytest.raises(BootstrapError, match="unreachable"):
        register_rank("http://127.0.0.1:1", rank(0), REGISTRY, timeout_s=1)


@pytest.mark.fast
@pytest.mark.parametrize("host,port,allowed,expect", [
    ("127.0.0.1", 8998, (), "http://127.0.0.1:8998"),
    ("::1", 8998, (), "http://[::1]:8998"),
    ("prefill-0.pd.svc", 8998, ("prefill-0.pd.svc",), "http://prefill-0.pd.svc:8998"),
    ("127.0.0.1:32001/secret-path#", 8998, (), "bootstrap_host: .* is not a hostname"),
    ("user@evil", 1, (), "bootstrap_host"),
    ("", 1, (), "bootstrap_host"),
    (7, 1, (), "bootstrap_host"),
    ("h", "8998", (), "bootstrap_port"),
    ("h", True, (), "bootstrap_port"),
    ("h", 0, (), "bootstrap_port"),
    ("10.0.0.9", 8998, ("10.0.0.1", "10.0.0.9:9000"), "not among this server's --disaggregation-allowed-prefill"),
])
def test_bootstrap_addresses_from_clients_are_checked(host, port, allowed, expect):
    from pdserve.disagg.bootstrap import bootstrap_url
    if expect.startswith("http"):
        assert bootstrap_url(host, port, allowed) == expect
    else:
        with pytest.raises(ValueError, match=expect):
            bootstrap_url(host, port, allowed)
