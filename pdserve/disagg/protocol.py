"""Wire messages between prefill and decode servers: frozen dataclasses, one codec.

A message is the JSON envelope ``{"v": PROTOCOL_VERSION, "type": NAME, "body": {...}}``.
Unsigned (no deployment secret) a frame is that JSON. With a secret, a frame is
``SIGNED_TAG + hex(HMAC-SHA256(payload)) + b":" + payload``, where the payload is the
JSON envelope with ``from`` (the sender), ``to`` (the recipient, as the sender
addresses it), ``ts`` and ``nonce`` added (``Authenticator``). The MAC covers the
exact bytes sent, so a receiver checks, in this order and before anything parses
the frame: its length (``MAX_FRAME_BYTES``), its MAC over the raw bytes; then, on
the parsed envelope, that it is addressed to this receiver, fresh (a finite
timestamp within the window) and not replayed. A frame that is oversized,
unsigned, forged, addressed elsewhere, stale or replayed is refused before
anything reads its body.
Decoding is strict: an unknown type, a missing or unknown field, a wrong
protocol version or a malformed body raises ``ProtocolError`` naming it, so
two servers of different versions fail at their first exchange instead of
misreading each other (SGLang's positional multipart frames grow by appending
optional fields and are told apart by sentinel strings).
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import hmac
import json
import math
import secrets
import threading
import time
import types
import typing
from dataclasses import dataclass
from typing import Any

from pdserve.disagg.layout import PROTOCOL_VERSION, BufferSpec, CompatRecord, HeadRange, KVLayout


class ProtocolError(ValueError):
    pass


class AuthError(ProtocolError):
    """A message that is not signed by a holder of the deployment's secret for this
    receiver (or stale, or replayed)."""


# The largest frame a receiver reads (and a sender builds). The largest legitimate
# message is a TransferRequest: one destination slot per prompt position, at most 11
# bytes each in JSON (a slot index below 2**31: 10 digits and a comma), so a
# 1M-token prompt (2**20 positions) needs 11.5 MB; the next largest, a Handshake or
# RankInfo, lists one ~200-byte BufferSpec per KV buffer (a few hundred: under
# 100 KB). 16 MiB holds the 1M-token request with 45% to spare while bounding what
# a forged frame costs a receiver to one HMAC over 16 MiB (~10-30 ms, outside the
# GIL), never a parse. ZMQ drops larger frames before Python sees them (MAXMSGSIZE).
MAX_FRAME_BYTES = 16 << 20

SIGNED_TAG = b"pdserve-hmac-sha256:"
_MAC_HEX = 64
_SEP = b":"                                # after the MAC (a frame also travels as an HTTP header)
_HEADER = len(SIGNED_TAG) + _MAC_HEX + 1   # tag, MAC, separator
_ENVELOPE = {"v", "type", "body"}
_SIGNED = _ENVELOPE | {"from", "to", "ts", "nonce"}


def _finite(ts: Any) -> float | None:
    """``ts`` as a float if it is a finite number (NaN compares false with everything:
    it would pass a window check and stall the nonce expiry), else None."""
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return None
    try:
        value = float(ts)
    except OverflowError:  # an integer beyond any float
        return None
    return value if math.isfinite(value) else None


class Authenticator:
    """Signs and checks control messages with a shared secret. ``identity`` names this
    side: the ``from`` of what it signs and, by default, the ``to`` a message must
    carry for it to accept it (its control address: what its peers send to). A
    message is accepted once, within ``window_s`` of its timestamp (clocks of a
    deployment agree to well within that); nonces are remembered until their message
    would be stale anyway, to refuse replays."""

    def __init__(self, secret: bytes, identity: str, window_s: float = 120.0) -> None:
        if len(secret) < 16:
            raise ValueError("the secret must be at least 16 bytes")
        self._key = hashlib.sha256(b"pdserve-control:" + secret).digest()
        self.identity = identity
        self.window_s = window_s
        self._seen: set[str] = set()                 # nonces of accepted, still fresh messages
        self._expiry: list[tuple[float, str]] = []   # heap: (when a nonce's message turns stale, nonce)
        self._lock = threading.Lock()
        self.refused = 0   # messages refused (unsigned, forged, misaddressed, stale, replayed)

    def mac(self, payload: bytes | memoryview) -> bytes:
        """The hex HMAC of a frame's payload (the exact bytes that follow the header)."""
        return hmac.new(self._key, payload, hashlib.sha256).hexdigest().encode()

    def seal(self, envelope: dict[str, Any], to: str) -> bytes:
        """A signed frame carrying ``envelope`` to ``to`` (the recipient's identity)."""
        signed = {**envelope, "from": self.identity, "to": to, "ts": time.time(), "nonce": secrets.token_hex(12)}
        return self.frame(json.dumps(signed, separators=(",", ":")).encode())

    def frame(self, payload: bytes) -> bytes:
        return SIGNED_TAG + self.mac(payload) + _SEP + payload

    def open(self, data: bytes, recipient: str | None = None) -> dict[str, Any]:
        """The envelope of ``data`` if it is a frame signed with our secret for
        ``recipient`` (default: our identity), fresh and not seen before; else
        AuthError. The MAC is checked over the raw bytes before they are parsed."""
        try:
            if not data.startswith(SIGNED_TAG):
                raise AuthError("unsigned message (this server requires --disaggregation-secret signatures; "
                                "or a peer of another pdserve version)")
            view = memoryview(data)
            if len(data) < _HEADER or data[_HEADER - 1:_HEADER] != _SEP or not hmac.compare_digest(
                    bytes(view[len(SIGNED_TAG):_HEADER - 1]), self.mac(view[_HEADER:])):
                raise AuthError("bad signature (a different --disaggregation-secret, or a forgery)")
            try:  # signed by a holder of the secret: only now is it parsed
                raw = json.loads(view[_HEADER:].tobytes())
            except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                raise AuthError(f"a signed frame that is not a pdserve message: {type(exc).__name__}") from None
            if not isinstance(raw, dict) or set(raw) != _SIGNED:
                raise AuthError("a signed frame that is not a pdserve message (expected v, type, body, from, to, "
                                "ts, nonce)")
            want = self.identity if recipient is None else recipient
            if raw["to"] != want:
                raise AuthError(f"a message for {str(raw['to'])[:200]!r}, not for this server ({want!r})")
            ts, nonce, now = _finite(raw["ts"]), raw["nonce"], time.time()
            if ts is None:
                raise AuthError("a signed message whose timestamp is not a finite number")
            if abs(now - ts) > self.window_s:
                raise AuthError("stale message (outside the replay window; are the clocks in sync?)")
            if not isinstance(nonce, str) or not nonce:
                raise AuthError("a signed message without a nonce")
            with self._lock:
                while self._expiry and self._expiry[0][0] < now:
                    self._seen.discard(heapq.heappop(self._expiry)[1])
                if nonce in self._seen:
                    raise AuthError("replayed message")
                self._seen.add(nonce)
                heapq.heappush(self._expiry, (ts + self.window_s, nonce))
            return raw
        except AuthError:
            with self._lock:
                self.refused += 1
            raise

    @property
    def remembered(self) -> int:
        """Nonces held for replay detection (dropped once their message is stale)."""
        with self._lock:
            return len(self._seen)


@dataclass(frozen=True)
class RankInfo:
    """A prefill rank as the bootstrap server lists it."""
    tp_rank: int
    tp_size: int
    host: str
    port: int            # the rank's handshake / control socket
    session_id: str      # its transfer-engine session (Mooncake: host:rpc_port; NIXL: its agent name)
    compat: CompatRecord
    layout: KVLayout


@dataclass(frozen=True)
class Handshake:
    """Decode rank -> prefill rank, once per pair: who I am, what I need, where it goes."""
    decode_id: str
    tp_rank: int
    tp_size: int
    session_id: str
    control_addr: str    # where prefill sends completions and heartbeats
    compat: CompatRecord
    layout: KVLayout
    wanted: tuple[str, ...]   # buffer names decode needs written (the rest it fills itself or ignores)
    # The per-position target feature decode's draft reads ("features" in wanted):
    # the residual streams entering these target layers, or () = the final normed hidden state.
    feature_layers: tuple[int, ...] = ()
    # What the prefill rank's engine needs to write into this rank's memory, base64
    # (NIXL's agent metadata: the memory keys); "" for engines that need none (Mooncake).
    engine_metadata: str = ""
    # This rank's landing area (landing.py), where a request with scattered slots may ask
    # for its KV packed instead (TransferRequest.landing_offset); None: it has none.
    landing: BufferSpec | None = None


@dataclass(frozen=True)
class HandshakeReply:
    sender: str          # the prefill rank's control address
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class TransferRequest:
    """Decode -> prefill per request: where the KV of room ``room`` goes."""
    room: int
    decode_id: str
    # Decode already holds the KV of prompt positions [0, first_position) (its prefix
    # cache; page aligned): prefill writes the positions from there on, one slot each.
    first_position: int
    dst_slots: tuple[int, ...]       # one per prompt position from first_position on
    want_features: bool = False      # decode drafts: send the target features of those positions too
    # Decode runs the same draft as prefill (CompatRecord.shares_draft_with): send the
    # draft KV of those positions and the record's DraftState instead of features.
    want_draft_state: bool = False
    # Bytes into decode's landing area (Handshake.landing) where this request's positions
    # go, packed (landing.landing_regions) instead of into dst_slots; -1: into dst_slots.
    landing_offset: int = -1


@dataclass(frozen=True)
class DraftState:
    """What decode's draft reads in its first round, at the draft's own width: the top-k
    candidates for the first output token (probabilities, target ids) and the draft's
    output at the last prompt position (little-endian float32, base64: exact for the
    16-bit dtypes; its width is the draft's hidden size, checked on arrival)."""
    topk_p: tuple[float, ...]
    topk_index: tuple[int, ...]
    hidden: str


# What crosses the split for a request, as counted (pdserve:kv_transfer_bytes_total{kind}):
# the target's KV, the draft's KV, per-position target features a decode draft reads,
# and the control messages' metadata (the handoff record: first token, logprobs).
TRANSFER_KINDS = ("target_kv", "draft_kv", "features", "metadata")


def payload_bytes(by_kind: dict[str, int]) -> int:
    """The bytes of transferred prompt positions (every kind but the metadata)."""
    return sum(n for kind, n in by_kind.items() if kind != "metadata")


@dataclass(frozen=True)
class HandoffRecord:
    """Prefill -> decode once all KV of the room is written: the commit message."""
    room: int
    sender: str          # the prefill rank's control address (each rank reports)
    first_token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[float, int], ...] = ()
    cached_tokens: int = 0
    draft_state: DraftState | None = None  # with want_draft_state


@dataclass(frozen=True)
class Abort:
    """Either side: the room failed (the reason reaches the client). It says nothing
    about writes still in flight: see WritesDone."""
    room: int
    reason: str


@dataclass(frozen=True)
class WritesDone:
    """Prefill rank -> decode, for a failed room: this sender's last write into the
    room's pages has returned and none will follow, so decode may reuse them. Sent
    per sender, only after its transfer thread drained the room's queued writes."""
    room: int
    sender: str          # the prefill rank's control address


@dataclass(frozen=True)
class Heartbeat:
    sender: str
    seq: int = 0


MESSAGES: dict[str, type] = {cls.__name__: cls for cls in (
    RankInfo, Handshake, HandshakeReply, TransferRequest, DraftState, HandoffRecord, Abort, WritesDone, Heartbeat,
    CompatRecord, KVLayout, BufferSpec, HeadRange)}
_TOP_LEVEL = ("RankInfo", "Handshake", "HandshakeReply", "TransferRequest", "HandoffRecord", "Abort", "WritesDone",
              "Heartbeat")


_SCALARS = (int, float, str, bool, type(None))


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        if all(type(x) in _SCALARS for x in obj):  # e.g. a long prompt's dst_slots: no call per item
            return list(obj)
        return [_to_plain(x) for x in obj]
    return obj


def encode(msg: Any, auth: Authenticator | None = None, to: str | None = None,
           max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """The frame of ``msg``: signed for recipient ``to`` with ``auth``, else plain JSON.
    A frame above ``max_bytes`` is refused here (ProtocolError): its receiver would drop it."""
    name = type(msg).__name__
    if name not in _TOP_LEVEL:
        raise ProtocolError(f"{name} is not a wire message")
    envelope: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": name, "body": _to_plain(msg)}
    if auth is not None:
        if not to:
            raise ProtocolError("a signed message needs its recipient (to)")
        data = auth.seal(envelope, to)
    else:
        data = json.dumps(envelope, separators=(",", ":")).encode()
    if len(data) > max_bytes:
        raise ProtocolError(f"a {name} of {len(data)} bytes exceeds the {max_bytes}-byte frame limit")
    return data


def to_body(msg: Any) -> dict[str, Any]:
    """A message's JSON body (for containers that list several messages)."""
    return _to_plain(msg)


def from_body(cls: type, body: Any) -> Any:
    """The inverse of ``to_body``, as strict as ``decode``."""
    return _build(cls, body, cls.__name__)


def decode(data: bytes, auth: Authenticator | None = None, recipient: str | None = None,
           max_bytes: int = MAX_FRAME_BYTES) -> Any:
    """The message in ``data``; with ``auth``, only if signed by a holder of the secret
    for ``recipient`` (default: ``auth.identity``). Nothing parses a frame above
    ``max_bytes``, nor a signed frame before its MAC is checked."""
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError(f"not a pdserve message: {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"a frame of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    data = bytes(data)
    if auth is not None:
        raw = auth.open(data, recipient)
    else:
        if data.startswith(SIGNED_TAG):
            raise ProtocolError("a signed message, but this server has no --disaggregation-secret")
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ProtocolError(f"not a pdserve message: {type(exc).__name__}") from None
        if not isinstance(raw, dict) or set(raw) != _ENVELOPE:
            raise ProtocolError("not a pdserve message (expected v, type, body)")
    if raw["v"] != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {raw['v']!r}; this server speaks {PROTOCOL_VERSION}")
    if raw["type"] not in _TOP_LEVEL:
        raise ProtocolError(f"unknown message type {raw['type']!r}")
    return _build(MESSAGES[raw["type"]], raw["body"], raw["type"])


def _build(cls: type, body: Any, where: str) -> Any:
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: expected an object, got {type(body).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(body) - names)
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {', '.join(unknown)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                raise ProtocolError(f"{where}: missing field {f.name}")
            continue
        kwargs[f.name] = _value(hints[f.name], body[f.name], f"{where}.{f.name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{where}: {exc}") from None


def _value(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0], value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] is int and all(type(v) is int for v in value):  # the common case, without a call per item
                return tuple(value)
            return tuple(_value(args[0], v, where) for v in value)
        if len(args) != len(value):
            raise ProtocolError(f"{where}: expected {len(args)} items")
        return tuple(_value(a, v, where) for a, v in zip(args, value))
    if isinstance(hint, type) and hint.__name__ in MESSAGES:
        return _build(hint, value, where)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected a number")
        return float(value)
    if hint in (int, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    return value


__all__ = ["ProtocolError", "encode", "decode", "to_body", "from_body", "RankInfo", "Handshake", "HandshakeReply", "TransferRequest",
           "DraftState", "HandoffRecord", "Abort", "WritesDone", "Heartbeat", "Authenticator", "AuthError",
           "MAX_FRAME_BYTES", "SIGNED_TAG"]
