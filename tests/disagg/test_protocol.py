"""The wire codec: every message round-trips exactly; anything else is refused by name."""

from __future__ import annotations

import json

import pytest

from pdserve.disagg import protocol as P
from pdserve.disagg.layout import PROTOCOL_VERSION, BufferSpec, CompatRecord, HeadRange, KVLayout

COMPAT = CompatRecord(PROTOCOL_VERSION, "LlamaForCausalLM", 4, 4, 32, "float32", 16, 104, "EAGLE3", 768, 2,
                      (("note", "x"),))
LAYOUT = KVLayout(16, (BufferSpec("target.L0.K", 1 << 40, 4096, 256, HeadRange(2, 2, 4)),
                       BufferSpec("features", 12345, 4096, 3072)))

MESSAGES = [
    P.RankInfo(0, 2, "127.0.0.1", 5555, "127.0.0.1:16000", COMPAT, LAYOUT),
    P.Handshake("dec-1", 1, 2, "127.0.0.1:17000", "tcp://127.0.0.1:6000", COMPAT, LAYOUT,
                ("target.L0.K", "target.L0.V")),
    P.HandshakeReply("tcp://127.0.0.1:5555", False, "page_size: 16 vs 1"),
    P.TransferRequest(2**63 - 1, "dec-1", 16, (5, 6, 7, 100), want_features=True),
    P.HandoffRecord(7, "tcp://127.0.0.1:5555", 42, -0.25, ((-0.25, 42), (-1.5, 3)), 16,
                    P.SpecHandoff((0.9, 0.1), (42, 7), (0.5, -0.5, 1.0))),
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
    (_raw("HandoffRecord", {"room": 1, "sender": "s", "first_token": 2, "spec": {"topk_p": [1.0]}}),
     "spec: missing field"),
])
def test_bad_messages_are_refused(data, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.decode(data)


def test_only_messages_encode():
    with pytest.raises(P.ProtocolError, match="not a wire message"):
        P.encode(COMPAT)


def test_signed_messages_are_checked_before_their_body_is_read():
    import json as _json
    import time as _time
    sender, receiver = P.Authenticator(b"s" * 16, "tcp://a:1"), P.Authenticator(b"s" * 16, "tcp://b:2")
    msg = P.HandoffRecord(7, "tcp://a:1", first_token=5)
    data = P.encode(msg, sender)
    assert P.decode(data, receiver) == msg
    with pytest.raises(P.AuthError, match="replayed"):
        P.decode(data, receiver)
    with pytest.raises(P.AuthError, match="unsigned"):
        P.decode(P.encode(msg), receiver)
    with pytest.raises(P.AuthError, match="bad signature"):
        P.decode(P.encode(msg, P.Authenticator(b"t" * 16, "tcp://a:1")), receiver)
    tampered = _json.loads(P.encode(msg, sender))
    tampered["body"]["first_token"] = 6  # a chosen token under a real signature
    with pytest.raises(P.AuthError, match="bad signature"):
        P.decode(_json.dumps(tampered).encode(), receiver)
    stale = sender.seal({"v": PROTOCOL_VERSION, "type": "Abort", "body": {"room": 1, "reason": "x"}})
    stale["ts"] = _time.time() - 3600
    stale["mac"] = sender.mac({k: v for k, v in stale.items() if k != "mac"})
    with pytest.raises(P.AuthError, match="stale"):
        P.decode(_json.dumps(stale).encode(), receiver)
    assert receiver.refused == 5
    with pytest.raises(P.ProtocolError, match="no --disaggregation-secret"):
        P.decode(P.encode(msg, sender))  # a signed message to a server without a secret
    with pytest.raises(ValueError):
        P.Authenticator(b"short", "x")
