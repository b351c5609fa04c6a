"""The PD control plane against a hostile client, on real prefill and decode servers
(loopback, a shared --disaggregation-secret):

1. a bootstrap_room already in use on a decode server is a 400, the server stays up;
2. forged control messages (a handoff record with a chosen first token, an abort) are
   dropped unread and counted, and so are messages signed with the real secret but
   addressed to another server, or with a NaN / infinite timestamp; the request is
   answered from the real transfer only; the registry refuses registrations from
   anyone but the server's own ranks and the rank listing to anyone without the
   secret (or with a listing request signed for another bootstrap server);
3. forged frames over the control link's frame limit are dropped by libzmq unseen;
   forged frames just under it are refused on their MAC, unparsed, in milliseconds;
4. a bootstrap_host that is not a plain host (a path, a fragment) or not allowed is a
   400 naming it, and nothing is fetched;
5. on NIXL, a forged handshake carrying another agent's metadata (the memory keys a
   prefill rank would write a room's KV with) is dropped unread, and the room's KV goes
   only to the real decode server; one signed with the secret but carrying metadata
   NIXL cannot load is refused with a reason;
6. every socket a NIXL pair listens on is on the interface of --host (loopback here);
   Mooncake's transfer ports listen on every interface;
and after each attack the servers are healthy and a normal request is answered."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
import urllib.error
import urllib.request

import httpx
import pytest
import zmq

from pdserve.disagg import protocol as P
from pdserve.disagg.bootstrap import REGISTRY_RECIPIENT
from pdserve.disagg.layout import PROTOCOL_VERSION
from pdserve.testing import build_random_model
from tests.disagg.test_pd_servers import pd_pair
from tests.server.conftest import free_port
from tests.waiting import wait_until

SECRET = "a-deployment-secret-for-tests"
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("sec") / "t", "llama", num_layers=2)


def _pair(target, backend: str):
    boot = free_port()
    flags = ("--disaggregation-secret", SECRET)
    return boot, pd_pair(target, boot, flags, flags + ("--disaggregation-allowed-prefill", "127.0.0.1"),
                         backend=backend)


@pytest.fixture(scope="module")
def pair(target):
    boot, servers = _pair(target, "mooncake")
    with servers as (p, d):
        yield p, d, boot


@pytest.fixture(scope="module")
def nixl_pair(target):
    pytest.importorskip("nixl_cu12", reason="the nixl extra (pip install -e '.[nixl]') is not installed")
    boot, servers = _pair(target, "nixl")
    with servers as (p, d):
        yield p, d, boot


def state(server) -> dict:
    return httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_state"]


def openai_body(boot: int, room: int, **extra) -> dict:
    """A completion request with the PD fields (the OpenAI routes answer refusals with 400)."""
    return {"prompt": "hello", "max_tokens": 4, "temperature": 0, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": boot, "bootstrap_room": room, **extra}


def native_body(boot: int, room: int) -> dict:
    return {"input_ids": PROMPT, "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": boot, "bootstrap_room": room}


async def decode_leg_admitted(c: httpx.AsyncClient, d, body: dict) -> asyncio.Task:
    """Send a decode leg alone (its prefill leg not yet) and wait until decode holds it."""
    leg = asyncio.create_task(c.post(d.url + "/generate", json=body))
    await asyncio.to_thread(wait_until, lambda: state(d)["disaggregation"]["transferring"] == 1, 30)
    return leg


async def both_legs(p, d, boot: int, room: int) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as c:
        body = native_body(boot, room)
        rp, rd = await asyncio.gather(c.post(p.url + "/generate", json=body), c.post(d.url + "/generate", json=body))
    assert rp.status_code == 200, rp.text
    return rd


def push_frames(addr: str, frames: list[bytes]) -> None:
    """Send ``frames`` to a control socket on a forger's own PUSH connection, then close it
    (waiting up to 1 s for them to leave)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(addr)
    for frame in frames:
        sock.send(frame)
    sock.close(linger=1000)
    ctx.term()


def normal_request_works(p, d, boot: int) -> list[int]:
    rd = asyncio.run(both_legs(p, d, boot, random.getrandbits(62)))
    assert rd.status_code == 200, rd.text
    return rd.json()["output_ids"]


def test_a_room_in_use_on_decode_is_a_400_and_the_server_stays_up(pair):
    p, d, boot = pair
    expected = normal_request_works(p, d, boot)
    room = random.getrandbits(62)

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            body = native_body(boot, room)
            first = await decode_leg_admitted(c, d, body)
            second = await c.post(d.url + "/v1/completions", json=openai_body(boot, room))
            assert second.status_code == 400 and "bootstrap_room" in second.text, second.text
            rp = await c.post(p.url + "/generate", json=body)  # the first one's prefill leg
            assert rp.status_code == 200, rp.text
            r1 = await first
            assert r1.status_code == 200 and r1.json()["output_ids"] == expected, r1.text
    asyncio.run(scenario())
    assert httpx.get(d.url + "/health", timeout=10).status_code == 200
    assert normal_request_works(p, d, boot) == expected


def test_forged_control_messages_are_dropped_and_counted(pair):
    """A forged handoff record with a chosen first token, and a forged abort, sent to the
    decode server's control socket while a request waits for its KV: both are dropped
    unread (counted), the request is answered from the real transfer."""
    p, d, boot = pair
    expected = normal_request_works(p, d, boot)
    info = state(d)["disaggregation"]
    addr, refused = info["control_addr"], info["refused_messages"]
    prefill_addr = state(p)["disaggregation"]["control_addr"]
    room = random.getrandbits(62)

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            body = native_body(boot, room)
            decode_leg = await decode_leg_admitted(c, d, body)
            forged = [P.HandoffRecord(room, prefill_addr, first_token=3),       # unsigned
                      P.Abort(room, "forged abort")]
            wrong_key = P.Authenticator(b"not-the-deployment-secret", prefill_addr)
            real_key = P.Authenticator(SECRET.encode(), prefill_addr)
            frames = []
            for msg in forged:
                frames += [P.encode(msg), P.encode(msg, wrong_key, to=addr),
                           # Signed with the deployment's secret, but for another server (captured
                           # on its way to the prefill server, or to another decode server).
                           P.encode(msg, real_key, to=prefill_addr), P.encode(msg, real_key, to="tcp://10.9.9.9:5555")]
                # Signed for this server, with a timestamp that is not a finite number.
                for ts in (b"NaN", b"Infinity", b"1e999"):
                    frames.append(real_key.frame(P.encode(msg)[:-1] + b',"from":"%s","to":"%s","ts":%s,"nonce":"%s"}'
                                                 % (prefill_addr.encode(), addr.encode(), ts, ts)))
            push_frames(addr, frames)
            await asyncio.to_thread(wait_until, lambda: state(d)["disaggregation"]["refused_messages"] >= refused + 14,
                                    10)
            assert not decode_leg.done()  # neither the record nor the abort was obeyed
            rp = await c.post(p.url + "/generate", json=body)
            assert rp.status_code == 200, rp.text
            rd = await decode_leg
            assert rd.status_code == 200 and rd.json()["output_ids"] == expected, rd.text
    asyncio.run(scenario())
    metrics = httpx.get(d.url + "/metrics", timeout=10).text
    assert "pdserve:disagg_refused_messages" in metrics
    assert normal_request_works(p, d, boot) == expected


def test_the_registry_is_written_and_read_only_by_the_deployment(pair):
    p, d, boot = pair
    url = f"http://127.0.0.1:{boot}/ranks"
    with pytest.raises(urllib.error.HTTPError) as err:  # the listing names buffer addresses
        urllib.request.urlopen(url, timeout=10)
    assert err.value.code == 401
    listing = P.Authenticator(SECRET.encode(), "anyone-with-the-secret")
    # A listing request names the bootstrap server it is for: one for another is refused.
    for other in ("pdserve-bootstrap-0123456789abcdef", "bootstrap", "tcp://127.0.0.1:1"):
        req = urllib.request.Request(url, headers={"X-Pdserve-Auth": P.encode(P.Heartbeat("x"), listing,
                                                                              to=other).decode()})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 401
    with urllib.request.urlopen(f"http://127.0.0.1:{boot}/health", timeout=10) as r:
        ident = json.loads(r.read())["id"]
    req = urllib.request.Request(url, headers={"X-Pdserve-Auth": P.encode(P.Heartbeat("x"), listing,
                                                                          to=ident).decode()})
    with urllib.request.urlopen(req, timeout=10) as r:
        (rank,) = [P.from_body(P.RankInfo, b) for b in json.loads(r.read())["ranks"]]
    # Even a holder of the deployment secret cannot overwrite the server's own ranks.
    evil = P.RankInfo(0, 1, "10.6.6.6", 1, "10.6.6.6:1", rank.compat, rank.layout)
    for data in (P.encode(evil), P.encode(evil, listing, to=REGISTRY_RECIPIENT), P.encode(evil, listing, to=ident)):
        put = urllib.request.Request(url, data=data, method="PUT")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(put, timeout=10)
        assert err.value.code == 403
    normal_request_works(p, d, boot)


def test_forged_frames_over_or_near_the_frame_limit_cost_no_parse(pair):
    """At both servers' control sockets: forged frames of 48 MiB (over the 16 MiB frame
    limit: libzmq drops them and their connection, nothing is counted) and of 15 MiB
    (under it: refused on their MAC over the raw bytes, never parsed). The 15 MiB
    ones are refused as fast as they arrive; a normal request is answered meanwhile
    and after."""
    p, d, boot = pair
    expected = normal_request_works(p, d, boot)
    forger = P.Authenticator(b"not-the-deployment-secret", "tcp://10.6.6.6:1")
    for server in (d, p):
        info = state(server)["disaggregation"]
        addr, refused = info["control_addr"], info["refused_messages"]

        def frame(positions: int) -> bytes:  # a TransferRequest of 10-digit slots, ~11 bytes each
            body = b'{"room":1,"decode_id":"d","first_position":0,"dst_slots":[%s1000000000]}' % (
                b"1000000000," * (positions - 1))
            return forger.frame(b'{"v":%d,"type":"TransferRequest","body":%s,"from":"x","to":"%s","ts":%f,'
                                b'"nonce":"%d"}' % (PROTOCOL_VERSION, body, addr.encode(), time.time(), positions))
        over, under = frame((48 << 20) // 11), frame((15 << 20) // 11)
        assert len(over) > P.MAX_FRAME_BYTES > len(under) > 14 << 20
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.connect(addr)
        t0 = time.monotonic()
        for _ in range(2):
            sock.send(over)
        sock.close(linger=10000)
        sock = ctx.socket(zmq.PUSH)  # a fresh connection: libzmq dropped the one above
        sock.connect(addr)
        for _ in range(8):
            sock.send(under)
        sock.close(linger=10000)
        ctx.term()
        wait_until(lambda: state(server)["disaggregation"]["refused_messages"] >= refused + 8, 30)
        elapsed = time.monotonic() - t0
        assert state(server)["disaggregation"]["refused_messages"] == refused + 8   # the 48 MiB ones: unseen
        print(f"{server.url}: 2 x {len(over) >> 20} MiB dropped, 8 x {len(under) >> 20} MiB refused "
              f"in {elapsed:.2f} s in all")
        assert normal_request_works(p, d, boot) == expected


@pytest.mark.parametrize("host,port,field", [
    ("127.0.0.1:32001/secret-path#", None, "bootstrap_host"),
    ("evil.example", None, "bootstrap_host"),     # not in --disaggregation-allowed-prefill
    ("127.0.0.1", "8998", "bootstrap_port"),
])
def test_bootstrap_addresses_are_checked_before_anything_is_fetched(pair, host, port, field):
    p, d, boot = pair
    t0 = time.monotonic()
    body = openai_body(boot, random.getrandbits(62), bootstrap_host=host, **({"bootstrap_port": port} if port else {}))
    r = httpx.post(d.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 30  # refused, not retried against the named address
    assert httpx.get(d.url + "/health", timeout=10).status_code == 200
    normal_request_works(p, d, boot)


def listening_sockets(server) -> set[tuple[str, int]]:
    """Every (address, port) a server's process tree listens on."""
    import psutil

    root = psutil.Process(server.proc.pid)
    return {(c.laddr.ip, c.laddr.port) for proc in [root, *root.children(recursive=True)]
            for c in proc.net_connections("all") if c.status == psutil.CONN_LISTEN}


def test_a_nixl_pair_listens_only_on_the_interface_of_its_host(nixl_pair, pair):
    p, d, boot = nixl_pair
    normal_request_works(p, d, boot)  # the transfer engines have connected
    for server in (p, d):
        listens = listening_sockets(server)
        assert listens and all(ip == "127.0.0.1" for ip, _ in listens), (server.url, sorted(listens))
    # Mooncake's RPC and data ports listen on every interface whatever --host says.
    mp, md, mboot = pair
    normal_request_works(mp, md, mboot)
    assert any(ip in ("0.0.0.0", "::") for server in (mp, md) for ip, _ in listening_sockets(server))


def _rank(boot: int) -> P.RankInfo:
    """The prefill rank as the registry lists it to a holder of the secret."""
    with urllib.request.urlopen(f"http://127.0.0.1:{boot}/health", timeout=10) as r:
        ident = json.loads(r.read())["id"]
    listing = P.Authenticator(SECRET.encode(), "a-test-client")
    req = urllib.request.Request(f"http://127.0.0.1:{boot}/ranks", headers={
        "X-Pdserve-Auth": P.encode(P.Heartbeat("x"), listing, to=ident).decode()})
    with urllib.request.urlopen(req, timeout=10) as r:
        (rank,) = [P.from_body(P.RankInfo, b) for b in json.loads(r.read())["ranks"]]
    return rank


def test_forged_nixl_metadata_is_dropped_and_the_kv_goes_only_to_decode(nixl_pair):
    """A forger's NIXL agent, with memory registered for the KV, sends the prefill rank a
    handshake carrying its metadata and a transfer request for a room decode is waiting
    on (unsigned, with another key, signed for another server): all dropped unread; the
    forger's memory stays untouched and the decode server gets the room's answer."""
    import torch

    from pdserve.disagg.nixl_engine import NixlTransfer

    p, d, boot = nixl_pair
    expected = normal_request_works(p, d, boot)
    rank = _rank(boot)
    prefill_addr = state(p)["disaggregation"]["control_addr"]
    refused = state(p)["disaggregation"]["refused_messages"]
    slots = len(PROMPT) + 4
    forger = NixlTransfer("127.0.0.1")
    trap = torch.zeros(slots * max(b.slot_bytes for b in rank.layout.buffers), dtype=torch.uint8)
    forger.register(trap.data_ptr(), trap.numel())
    layout = dataclasses.replace(rank.layout, buffers=tuple(
        dataclasses.replace(b, ptr=trap.data_ptr(), num_slots=slots) for b in rank.layout.buffers))
    evil_addr, room = f"tcp://127.0.0.1:{free_port()}", random.getrandbits(62)
    handshake = P.Handshake("decode-forger-r0", 0, 1, forger.session_id, evil_addr, rank.compat, layout,
                            tuple(b.name for b in rank.layout.buffers), (), forger.metadata())
    request = P.TransferRequest(room, "decode-forger-r0", 0, tuple(range(len(PROMPT))))
    try:
        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=120) as c:
                body = native_body(boot, room)
                decode_leg = await decode_leg_admitted(c, d, body)
                wrong_key = P.Authenticator(b"not-the-deployment-secret", evil_addr)
                real_key = P.Authenticator(SECRET.encode(), evil_addr)
                push_frames(prefill_addr, [frame for msg in (handshake, request) for frame in (
                    P.encode(msg), P.encode(msg, wrong_key, to=prefill_addr),
                    P.encode(msg, real_key, to="tcp://10.9.9.9:5555"))])
                await asyncio.to_thread(wait_until, lambda: state(p)["disaggregation"]["refused_messages"]
                                        >= refused + 6, 10)
                rp = await c.post(p.url + "/generate", json=body)
                assert rp.status_code == 200, rp.text
                rd = await decode_leg
                assert rd.status_code == 200 and rd.json()["output_ids"] == expected, rd.text
        asyncio.run(scenario())
        assert int(trap.count_nonzero()) == 0, "the prefill server wrote KV into the forger's memory"
        # Signed with the secret (an insider's bug, not a forgery): metadata NIXL cannot
        # load is refused at handshake, with the reason.
        ctx = zmq.Context()
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(evil_addr)
        out = ctx.socket(zmq.PUSH)
        out.connect(prefill_addr)
        bad = dataclasses.replace(handshake, engine_metadata="AAAAAAAAAAAA")
        out.send(P.encode(bad, P.Authenticator(SECRET.encode(), evil_addr), to=prefill_addr))
        assert inbox.poll(10000), "no handshake reply"
        reply = P.decode(inbox.recv(), P.Authenticator(SECRET.encode(), evil_addr))
        out.close(linger=0)
        inbox.close(linger=0)
        ctx.term()
        assert isinstance(reply, P.HandshakeReply) and not reply.ok
        assert "NIXL refused the metadata" in reply.error, reply.error
    finally:
        forger.close()
    assert normal_request_works(p, d, boot) == expected
