"""The wire codec: every message round-trips exactly; anything else is refused by name."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.disagg import protocol as P
from pdserve.disagg.layout import PROTOCOL_VERSION, BufferSpec, CompatRecord, HeadRange, KVLayout

pytestmark = pytest.mark.fast

COMPAT = CompatRecord(PROTOCOL_VERSION, "LlamaForCausalLM", 4, 4, 32, "float32", 16, 104, "EAGLE3", 768, 2,
                      (("note", "x"),), draft_identity="0123abcd", eagle_topk=4)
LAYOUT = KVLayout(16, (BufferSpec("target.L0.K", 1 << 40, 4096, 256, HeadRange(2, 2, 4)),
                       BufferSpec("features", 12345, 4096, 3072)))

MESSAGES = [
    P.RankInfo(0, 2, "127.0.0.1", 5555, "127.0.0.1:16000", COMPAT, LAYOUT),
    P.Handshake("dec-1", 1, 2, "127.0.0.1:17000", "tcp://127.0.0.1:6000", COMPAT, LAYOUT,
                ("target.L0.K", "target.L0.V")),
    P.HandshakeReply("tcp://127.0.0.1:5555", False, "page_size: 16 vs 1"),
    P.TransferRequest(2**63 - 1, "dec-1", 16, (5, 6, 7, 100), want_features=True),
    P.TransferRequest(3, "dec-1", 0, (5, 6), want_draft_state=True),
    P.HandoffRecord(7, "tcp://127.0.0.1:5555", 42, -0.25, ((-0.25, 42), (-1.5, 3)), 16,
                    P.DraftState((0.9, 0.1), (42, 7), "AAAAPwAAAL8AAIA/")),
    P.HandoffRecord(8, "tcp://127.0.0.1:5555", 1),
    P.Abort(7, "decode server is shutting down"),
    P.Heartbeat("prefill-0", 3),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=[type(m).__name__ for m in MESSAGES])
def test_round_trip(msg):
    assert P.decode(P.encode(msg)) == msg


def _raw(type_name: str, body: dict, v: int = PROTOCOL_VERSION) -> bytes:
    return json.dumps({"v": v, "type": type_name, "body": body}).encode()


@pytest.mark.parametrize("data,match", [
    (b"\xff\x00", "not a pdserve message"),
    (b"[1, 2]", "not a pdserve message"),
    (_raw("Abort", {"room": 1, "reason": "x"}, v=99), "protocol version 99"),
    (_raw("Sneaky", {}), "unknown message type"),
    (_raw("CompatRecord", {}), "unknown message type"),   # parts are not messages on their own
    (_raw("Abort", {"room": 1}), "missing field reason"),
    (_raw("Abort", {"room": 1, "reason": "x", "extra": 1}), "unknown field"),
    (_raw("Abort", {"room": "1", "reason": "x"}), "Abort.room: expected int"),
    (_raw("Abort", {"room": True, "reason": "x"}), "Abort.room: expected int"),
    (_raw("TransferRequest", {"room": 1, "decode_id": "d", "first_position": 0, "dst_slots": [1, "2"]}),
     "dst_slots"),
    (_raw("TransferRequest", {"room": 1, "decode_id": "d", "dst_slots": [1]}), "missing field first_position"),
    (_raw("HandoffRecord", {"room": 1, "sender": "s", "first_token": 2, "draft_state": {"topk_p": [1.0]}}),
     "draft_state: missing field"),
])
def test_bad_messages_are_refused(data, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.decode(data)


def test_only_messages_encode():
    with pytest.raises(P.ProtocolError, match="not a wire message"):
        P.encode(COMPAT)


A, B = "tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"   # two servers of one deployment


def _frame(auth: P.Authenticator, to: str, ts, nonce: str = "n1", **fields) -> bytes:
    """A signed frame with a chosen payload (what a holder of the secret could send)."""
    payload = {"v": PROTOCOL_VERSION, "type": "Abort", "body": {"room": 1, "reason": "x"}, "from": "tcp://c:1",
               "to": to, "ts": ts, "nonce": nonce, **fields}
    return auth.frame(json.dumps(payload, separators=(",", ":")).encode())


def test_signed_messages_are_checked_before_their_body_is_read():
    sender, receiver = P.Authenticator(b"s" * 16, "tcp://a:1"), P.Authenticator(b"s" * 16, A)
    msg = P.HandoffRecord(7, "tcp://a:1", first_token=5)
    data = P.encode(msg, sender, to=A)
    assert data.startswith(P.SIGNED_TAG)
    assert P.decode(data, receiver) == msg
    with pytest.raises(P.AuthError, match="replayed"):
        P.decode(data, receiver)
    with pytest.raises(P.AuthError, match="unsigned"):
        P.decode(P.encode(msg), receiver)
    with pytest.raises(P.AuthError, match="bad signature"):
        P.decode(P.encode(msg, P.Authenticator(b"t" * 16, "tcp://a:1"), to=A), receiver)
    tampered = P.encode(msg, sender, to=A).replace(b'"first_token":5', b'"first_token":6')  # a chosen token
    with pytest.raises(P.AuthError, match="bad signature"):
        P.decode(tampered, receiver)
    with pytest.raises(P.AuthError, match="bad signature"):
        P.decode(P.SIGNED_TAG + b"0" * 10, receiver)   # truncated
    with pytest.raises(P.AuthError, match="stale"):
        P.decode(_frame(sender, A, time.time() - 3600), receiver)
    assert receiver.refused == 6
    with pytest.raises(P.ProtocolError, match="no --disaggregation-secret"):
        P.decode(P.encode(msg, sender, to=A))  # a signed message to a server without a secret
    with pytest.raises(P.ProtocolError, match="recipient"):
        P.encode(msg, sender)                  # a signature names its recipient
    with pytest.raises(ValueError):
        P.Authenticator(b"short", "x")


def test_a_message_sealed_for_one_server_is_refused_by_another():
    """Servers A and B share the deployment secret: a message captured on its way to A
    (or after A accepted it) is refused by B, since the MAC covers its recipient."""
    sender = P.Authenticator(b"s" * 16, "tcp://decode:1")
    server_a, server_b = P.Authenticator(b"s" * 16, A), P.Authenticator(b"s" * 16, B)
    msg = P.Abort(3, "a real abort, for A")
    for_a = P.encode(msg, sender, to=A)
    with pytest.raises(P.AuthError, match="not for this server"):
        P.decode(for_a, server_b)
    assert P.decode(for_a, server_a) == msg
    with pytest.raises(P.AuthError, match="not for this server"):
        P.decode(for_a, server_b)                              # after A took it: still not B's
    # Rewriting the recipient breaks the MAC; a holder of the secret addressing B is heard.
    with pytest.raises(P.AuthError, match="bad signature"):
        P.decode(for_a.replace(A.encode(), B.encode()), server_b)
    assert P.decode(P.encode(msg, sender, to=B), server_b) == msg
    # The recipient to check can be given (the bootstrap registry checks a fixed name).
    assert P.decode(P.encode(msg, sender, to="registry"), server_a, recipient="registry") == msg
    assert server_b.refused == 3 and server_a.refused == 0


def test_non_finite_timestamps_are_refused_and_nonces_still_expire():
    """A timestamp must be a finite number within the window: NaN compares false with
    everything, so it once passed the window check and, remembered first, stopped
    every later nonce from being forgotten."""
    sender, receiver = P.Authenticator(b"s" * 16, "tcp://a:1"), P.Authenticator(b"s" * 16, A, window_s=0.3)
    for i, ts in enumerate(["NaN", "Infinity", "-Infinity", "1e400", "1" + "0" * 400, '"now"', "true", "null"]):
        payload = (b'{"v":%d,"type":"Abort","body":{"room":1,"reason":"x"},"from":"tcp://a:1","to":"%s",'
                   b'"ts":%s,"nonce":"bad%d"}' % (PROTOCOL_VERSION, A.encode(), ts.encode(), i))
        with pytest.raises(P.AuthError, match="timestamp is not a finite number"):
            P.decode(sender.frame(payload), receiver)
    assert receiver.remembered == 0 and receiver.refused == 8
    for i in range(20):
        P.decode(P.encode(P.Heartbeat("tcp://a:1", i), sender, to=A), receiver)
    assert receiver.remembered == 20
    time.sleep(0.4)                         # every one of them is stale now
    P.decode(P.encode(P.Heartbeat("tcp://a:1", 99), sender, to=A), receiver)
    assert receiver.remembered == 1         # the stale nonces were forgotten
    # A nonce is remembered while its message could pass: one a little in the future too.
    ahead = _frame(sender, A, time.time() + 0.2, nonce="ahead")
    P.decode(ahead, receiver)
    time.sleep(0.35)                        # past the window of "now", not of its own time
    with pytest.raises(P.AuthError, match="replayed"):
        P.decode(ahead, receiver)


class _CountingLoads:
    """json.loads, counting its calls (a refused frame must not reach it)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        real = json.loads

        def loads(*a, **k):
            self.calls += 1
            return real(*a, **k)
        monkeypatch.setattr(json, "loads", loads)


def _forged_request(positions: int, forger: P.Authenticator | None, to: str = A) -> bytes:
    """A TransferRequest frame of ``positions`` 10-digit destination slots, signed with
    the wrong key (or not at all)."""
    payload = (b'{"v":%d,"type":"TransferRequest","body":{"room":1,"decode_id":"d","first_position":0,'
               b'"dst_slots":[%s1000000000]},"from":"tcp://c:1","to":"%s","ts":%f,"nonce":"n"}'
               % (PROTOCOL_VERSION, b"1000000000," * (positions - 1), to.encode(), time.time()))
    if forger is None:
        return payload.replace(b',"from":"tcp://c:1","to":"%s"' % to.encode(), b"").split(b',"ts"')[0] + b"}"
    return forger.frame(payload)


def test_a_forged_oversize_frame_is_refused_before_it_is_parsed(monkeypatch):
    """The frame length is checked first, then the MAC over the raw bytes: a forged
    frame is never parsed. Timed against parsing the same bytes, as a ratio."""
    receiver, forger = P.Authenticator(b"s" * 16, A), P.Authenticator(b"f" * 16, A)
    huge = _forged_request(5_000_000, forger)                # 55 MB, over the frame limit
    under = _forged_request(P.MAX_FRAME_BYTES // 12, forger)  # just under it: the MAC is computed
    assert len(huge) > 50 << 20 and P.MAX_FRAME_BYTES // 2 < len(under) <= P.MAX_FRAME_BYTES
    parse = {}
    for name, data in (("huge", huge), ("under", under)):
        t0 = time.perf_counter()
        json.loads(data[len(P.SIGNED_TAG) + 65:])
        parse[name] = time.perf_counter() - t0
    loads = _CountingLoads(monkeypatch)
    t0 = time.perf_counter()
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.decode(huge, receiver)
    refuse_huge = time.perf_counter() - t0
    t0 = time.perf_counter()
    with pytest.raises(P.AuthError, match="bad signature"):
        P.decode(under, receiver)
    refuse_under = time.perf_counter() - t0
    assert loads.calls == 0
    print(f"huge {len(huge) >> 20} MiB: refused in {refuse_huge * 1e3:.3f} ms, parsed in {parse['huge'] * 1e3:.0f} ms;"
          f" under the limit {len(under) >> 20} MiB: refused in {refuse_under * 1e3:.1f} ms (its MAC), parsed in "
          f"{parse['under'] * 1e3:.0f} ms")
    assert refuse_huge < parse["huge"] / 100     # a length check
    assert refuse_under < parse["under"] / 3     # one HMAC, outside the GIL, no parse
    # Without a secret the limit comes first too; a sender never builds such a frame.
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.decode(_forged_request(5_000_000, None))
    assert loads.calls == 0
    with pytest.raises(P.ProtocolError, match="frame limit"):
        P.encode(P.TransferRequest(1, "d", 0, tuple(range(10**9, 10**9 + 200))), forger, to=A, max_bytes=2000)


def test_the_frame_limit_holds_the_largest_legitimate_message():
    """A TransferRequest for a 1M-token prompt with the widest slot numbers (10 digits)
    fits the limit, signed, and round-trips."""
    sender, receiver = P.Authenticator(b"s" * 16, "tcp://decode:1"), P.Authenticator(b"s" * 16, A)
    msg = P.TransferRequest(2**63 - 1, "decode-0123456789ab-r0", 0, tuple(range(2**31 - 2**20, 2**31)), True)
    data = P.encode(msg, sender, to=A)
    assert len(data) < P.MAX_FRAME_BYTES * 0.7
    assert P.decode(data, receiver) == msg
    # A Handshake listing a thousand KV buffers is far below it.
    layout = KVLayout(16, tuple(BufferSpec(f"target.L{i}.K", 1 << 47, 10**7, 4096, HeadRange(0, 8, 8))
                                for i in range(1000)))
    hs = P.Handshake("decode-0123456789ab-r0", 0, 1, "10.0.0.1:16000", B, COMPAT, layout, layout.names)
    assert len(P.encode(hs, sender, to=A)) < P.MAX_FRAME_BYTES / 50
