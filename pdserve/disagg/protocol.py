"""Wire messages between prefill and decode servers: frozen dataclasses, one codec.

Every message travels as JSON ``{"v": PROTOCOL_VERSION, "type": NAME, "body": {...}}``;
with a deployment secret it also carries ``from`` (the sender's identity), ``ts``,
``nonce`` and ``mac``, an HMAC-SHA256 over all of them (``Authenticator``): a
message that is unsigned, forged, stale or replayed is refused before anything
reads its body.
Decoding is strict: an unknown type, a missing or unknown field, a wrong
protocol version or a malformed body raises ``ProtocolError`` naming it, so
two servers of different versions fail at their first exchange instead of
misreading each other (SGLang's positional multipart frames grow by appending
optional fields and are told apart by sentinel strings).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
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
    """A message that is not signed by a holder of the deployment's secret (or replayed)."""


_ENVELOPE = {"v", "type", "body"}
_SIGNED = _ENVELOPE | {"from", "ts", "nonce", "mac"}


def _canonical(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


class Authenticator:
    """Signs and checks control messages with a shared secret. ``identity`` is the
    signer's own name (its control address), covered by the MAC. A message is accepted
    once, within ``window_s`` of its timestamp (clocks of a deployment agree to well
    within that); nonces seen in the window are remembered to refuse replays."""

    def __init__(self, secret: bytes, identity: str, window_s: float = 120.0) -> None:
        if len(secret) < 16:
            raise ValueError("the secret must be at least 16 bytes")
        self._key = hashlib.sha256(b"pdserve-control:" + secret).digest()
        self.identity = identity
        self.window_s = window_s
        self._seen: dict[str, float] = {}   # nonce -> its message's timestamp, oldest first
        self._lock = threading.Lock()
        self.refused = 0                    # messages refused (forged, unsigned, stale, replayed)

    def mac(self, fields: dict[str, Any]) -> str:
        return hmac.new(self._key, _canonical(fields), hashlib.sha256).hexdigest()

    def seal(self, envelope: dict[str, Any]) -> dict[str, Any]:
        signed = {**envelope, "from": self.identity, "ts": time.time(), "nonce": secrets.token_hex(12)}
        return {**signed, "mac": self.mac(signed)}

    def check(self, raw: dict[str, Any]) -> None:
        """Raise AuthError unless ``raw`` is a fresh message signed with our secret."""
        try:
            if set(raw) != _SIGNED:
                raise AuthError("unsigned message (this server requires --disaggregation-secret signatures)")
            mac = raw["mac"]
            if not isinstance(mac, str) or not hmac.compare_digest(
                    mac, self.mac({k: v for k, v in raw.items() if k != "mac"})):
                raise AuthError("bad signature (a different --disaggregation-secret, or a forgery)")
            ts, nonce, now = raw["ts"], raw["nonce"], time.time()
            if not isinstance(ts, (int, float)) or abs(now - ts) > self.window_s:
                raise AuthError("stale message (outside the replay window; are the clocks in sync?)")
            with self._lock:
                while self._seen and next(iter(self._seen.values())) < now - self.window_s:
                    self._seen.pop(next(iter(self._seen)))
                if nonce in self._seen:
                    raise AuthError("replayed message")
                self._seen[str(nonce)] = float(ts)
        except AuthError:
            with self._lock:
                self.refused += 1
            raise


@dataclass(frozen=True)
class RankInfo:
    """A prefill rank as the bootstrap server lists it."""
    tp_rank: int
    tp_size: int
    host: str
    port: int            # the rank's handshake / control socket
    session_id: str      # its transfer-engine session (host:rpc_port)
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


@dataclass(frozen=True)
class SpecHandoff:
    """What decode's draft needs to start at its first step (the draft's own width)."""
    topk_p: tuple[float, ...]
    topk_index: tuple[int, ...]
    hidden: tuple[float, ...]


@dataclass(frozen=True)
class HandoffRecord:
    """Prefill -> decode once all KV of the room is written: the commit message."""
    room: int
    sender: str          # the prefill rank's control address (each rank reports)
    first_token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[float, int], ...] = ()
    cached_tokens: int = 0
    spec: SpecHandoff | None = None


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
    RankInfo, Handshake, HandshakeReply, TransferRequest, SpecHandoff, HandoffRecord, Abort, WritesDone, Heartbeat,
    CompatRecord, KVLayout, BufferSpec, HeadRange)}
_TOP_LEVEL = ("RankInfo", "Handshake", "HandshakeReply", "TransferRequest", "HandoffRecord", "Abort", "WritesDone",
              "Heartbeat")


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [_to_plain(x) for x in obj]
    return obj


def encode(msg: Any, auth: Authenticator | None = None) -> bytes:
    name = type(msg).__name__
    if name not in _TOP_LEVEL:
        raise ProtocolError(f"{name} is not a wire message")
    envelope: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": name, "body": _to_plain(msg)}
    if auth is not None:
        envelope = auth.seal(envelope)
    return json.dumps(envelope, separators=(",", ":")).encode()


def to_body(msg: Any) -> dict[str, Any]:
    """A message's JSON body (for containers that list several messages)."""
    return _to_plain(msg)


def from_body(cls: type, body: Any) -> Any:
    """The inverse of ``to_body``, as strict as ``decode``."""
    return _build(cls, body, cls.__name__)


def decode(data: bytes, auth: Authenticator | None = None) -> Any:
    """The message in ``data``; with ``auth``, only if signed by a holder of the secret."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolError(f"not a pdserve message: {type(exc).__name__}") from None
    if not isinstance(raw, dict) or not _ENVELOPE <= set(raw):
        raise ProtocolError("not a pdserve message (expected v, type, body)")
    if auth is not None:
        auth.check(raw)
    elif set(raw) != _ENVELOPE:
        raise ProtocolError("a signed message, but this server has no --disaggregation-secret")
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
           "SpecHandoff", "HandoffRecord", "Abort", "WritesDone", "Heartbeat", "Authenticator", "AuthError"]
