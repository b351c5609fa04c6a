"""What stands between a socket and the routes: the limits a hostile or broken client meets
before any request is parsed.

- `ReadDeadlineH11Protocol` (uvicorn's h11 protocol, given to `uvicorn.Config(http=...)`):
  a request's headers and body must arrive within `--request-read-timeout` of its first
  byte (of the connection, for a fresh one); otherwise the connection is closed, after a
  408 when the client had started a request. Headers above `MAX_HEADER_BYTES` get a 431.
  A connection closed while the client is still sending (a 413, a 431) is closed
  "lingering": the answer is written, our side shut, and what the client still sends is
  read and dropped for up to `LINGER_S`, so that it reads the answer instead of a reset.
  A client that takes none of what is sent to it for `--send-timeout` seconds (the
  transport's buffer full, so the response waits on it) is dropped: the connection is
  aborted and the route sees the client gone (a stream's request is aborted, its KV freed).
- `KeyCheck` (ASGI): `--api-key` on every route but /health, `--admin-api-key` on the
  admin routes (without one, the admin routes answer loopback clients only); keys
  compared in constant time.
- `BodyLimit` (ASGI): a body above `--max-request-bytes` gets a 413 before it is parsed,
  whether it announced its length (Content-Length) or not (chunked).

Every refusal is OpenAI's error body (`http_common.error_body`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hmac
import ipaddress
import json
import logging
import socket
import struct
import sys
import termios
from typing import Any, Awaitable, Callable, Collection, MutableMapping

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_HEADER_BYTES = 64 * 1024   # request line + headers; above: 431


def error_body(message: str, kind: str, param: str | None, code: int | str) -> dict[str, Any]:
    """OpenAI's error shape, used by every route (SGLang's router expects it too)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
LINGER_S = 2.0                 # how long a closing connection drains what the client still sends
logger = logging.getLogger(__name__)
# ioctl request for a socket's unsent + unacknowledged bytes (Linux's SIOCOUTQ, which is
# TIOCOUTQ's number); None elsewhere: only our own buffer is watched there.
_SIOCOUTQ: int | None = getattr(termios, "TIOCOUTQ", None) if sys.platform == "linux" else None
ADMIN_PATHS = frozenset({"/abort_request", "/flush_cache", "/drain"})
OPEN_PATHS = frozenset({"/health"})  # no key needed (load balancers, orchestrators)


def error_bytes(message: str, status: int, kind: str = "invalid_request_error") -> bytes:
    return json.dumps(error_body(message, kind, None, status)).encode()


async def send_error(send: Send, message: str, status: int, kind: str = "invalid_request_error",
                     close: bool = False) -> None:
    """An OpenAI-shaped error as the whole response; ``close``: end the connection after it
    (the client may still be sending a body nobody will read)."""
    body = error_bytes(message, status, kind)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ---- keys ---------------------------------------------------------------------------------
def bearer(scope: Scope) -> bytes | None:
    """The raw Authorization header of a request, if any."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return value
    return None


def key_matches(given: bytes | None, key: str | None) -> bool:
    """Whether the Authorization header is `Bearer KEY`, compared in constant time (the
    time it takes says nothing about how much of the key a guess got right)."""
    if given is None or not key:
        return False
    return hmac.compare_digest(given, b"Bearer " + key.encode())


def is_admin(scope: Scope, admin_api_key: str | None) -> bool:
    return key_matches(bearer(scope), admin_api_key)


def is_loopback_client(scope: Scope) -> bool:
    """Whether the peer of the connection is a loopback address (127.0.0.0/8, ::1, or
    127.x as an IPv4-mapped IPv6 address). No peer address (not TCP) is not loopback."""
    client = scope.get("client")
    if not client:
        return False
    try:
        ip = ipaddress.ip_address(str(client[0]).split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


class KeyCheck:
    """ASGI middleware. With --api-key, every route but /health needs `Bearer KEY` (the admin
    key is accepted too). The admin routes (`admin_paths`, and paths under `admin_prefixes`:
    the servers' /abort_request, /flush_cache and /drain) act on other clients' requests, on
    the shared cache and on the process's life: with --admin-api-key they need `Bearer
    ADMIN_KEY` (the API key is not enough: 401); without one they answer only loopback
    clients (403 to any other, naming the flag), and those still need the API key if one is
    set. Loopback is trusted because whoever can connect from it can already signal the
    process; a reverse proxy on the same machine makes every client loopback: give it an
    admin key."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None,
                 admin_paths: Collection[str] = ADMIN_PATHS, admin_prefixes: tuple[str, ...] = ()) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.admin_paths = frozenset(admin_paths)
        self.admin_prefixes = admin_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path, given = scope["path"], bearer(scope)
            admin_route = path in self.admin_paths or path.startswith(self.admin_prefixes)
            if admin_route and self.admin_api_key:
                if not key_matches(given, self.admin_api_key):
                    return await send_error(send, f"{path} is an admin route: it needs the admin API key "
                                            "(Authorization: Bearer KEY of --admin-api-key); the API key is "
                                            "not enough", 401, "authentication_error")
            elif admin_route and not is_loopback_client(scope):
                return await send_error(send, f"{path} is an admin route: without --admin-api-key it answers only "
                                        "loopback clients (127.0.0.0/8, ::1); set --admin-api-key and send "
                                        "that key", 403, "permission_error")
            elif self.api_key and path not in OPEN_PATHS:
                if not (key_matches(given, self.api_key) or key_matches(given, self.admin_api_key)):
                    return await send_error(send, "invalid or missing API key", 401, "authentication_error")
        await self.app(scope, receive, send)


# ---- body size ----------------------------------------------------------------------------
class BodyLimit:
    """ASGI middleware: reads the body before the app does, counting its bytes. A body that
    announces or reaches more than `max_bytes` gets a 413 (and the connection is closed)
    before anything parses it; the app then gets the body in one message."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self, size: str) -> str:
        return f"body: {size} bytes exceed the limit of {self.max_bytes} bytes (--max-request-bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            # h11 has already refused a Content-Length that is not a number.
            if name == b"content-length" and int(value) > self.max_bytes:
                return await send_error(send, self.too_large(str(int(value))), 413, close=True)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone (or timed out by the protocol): nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await send_error(send, self.too_large(f"more than {self.max_bytes}"),
                                        413, close=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: bytes | None = b"".join(chunks)
        chunks.clear()

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            return await receive()  # after the body: the disconnect watch of the routes
        await self.app(scope, replay, send)


# ---- the connection -----------------------------------------------------------------------
class _Transport:
    """The transport as uvicorn sees it: the same, but close() is the protocol's lingering
    close (uvicorn closes the transport itself after an answer with `connection: close`)."""

    def __init__(self, real: asyncio.Transport, protocol: "ReadDeadlineH11Protocol") -> None:
        self._real = real
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_lingering()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._real.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class ReadDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read deadline per request and lingering closes (see the
    module doc). `protocol_class(read_timeout)` makes the class uvicorn instantiates."""

    read_timeout = 10.0
    send_timeout: float | None = None  # None: a client may stop reading for ever

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline: asyncio.TimerHandle | None = None
        self.lingering = False
        self.raw: asyncio.Transport | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._send_left = 0  # bytes the client had not taken at the last look (see _untaken)

    # ---- send deadline --------------------------------------------------------------------
    # asyncio pauses writing once the transport buffers more than its high-water mark (the
    # kernel's socket buffers are full: the client is not reading), and uvicorn's send()
    # then waits: a stream stops producing and holds its connection, its request and, on a
    # finished request, its output. nginx's send_timeout: the client gets `send_timeout`
    # seconds to take something; one that took nothing in that time is gone.
    def pause_writing(self) -> None:
        super().pause_writing()
        if self.send_timeout is not None and self._send_timer is None and self.raw is not None:
            self._send_left = self._untaken()
            self._send_timer = self.loop.call_later(self.send_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_send_timer()

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _untaken(self) -> int:
        """Bytes written that the client has not taken: our transport's buffer and the
        kernel's send queue (SIOCOUTQ: unsent or unacknowledged; Linux). The kernel's
        count moves as soon as the client reads; our buffer only once a good part of the
        kernel's (megabytes on loopback) is free, long after a slow reader took some."""
        assert self.raw is not None
        left = self.raw.get_write_buffer_size()
        sock = self.raw.get_extra_info("socket")
        if sock is not None and _SIOCOUTQ is not None:
            with contextlib.suppress(OSError, ValueError):
                left += struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0" * 4))[0]
        return left

    def _send_timed_out(self) -> None:
        self._send_timer = None
        if self.raw is None or self.send_timeout is None:
            return
        left = self._untaken()
        if left == 0:
            return
        if left < self._send_left:  # it took some (a slow reader, not a gone one): another period
            self._send_left = left
            self._send_timer = self.loop.call_later(self.send_timeout, self._send_timed_out)
            return
        logger.warning("dropped client %s: it took none of its response for %g s (--send-timeout)",
                       "%s:%d" % self.client if self.client else "?", self.send_timeout)
        # A reset, not a close: close() would wait for our buffer to drain, and even a
        # closed socket keeps its unsent bytes (megabytes on loopback) in the kernel until
        # this client reads them or TCP gives up, minutes later. connection_lost follows:
        # uvicorn marks the request disconnected and wakes its send(), so the route sees
        # the client gone.
        sock = self.raw.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.raw.abort()

    # ---- deadline -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.raw = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        self._arm()  # a fresh connection must bring a request, not sit idle

    def _arm(self) -> None:
        if self.deadline is None:
            self.deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _partial_request(self) -> bool:
        """The client has sent part of a request line / headers and no complete request."""
        return self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # closing: what the client still sends is dropped
        super().data_received(data)
        # A request being received runs against its deadline, armed at its first byte; once
        # it is all in (or between requests, where uvicorn's keep-alive timeout applies) none.
        if self.conn.their_state is h11.SEND_BODY or self._partial_request():
            self._arm()
        else:
            self._disarm()

    def _read_timed_out(self) -> None:
        self.deadline = None
        if self.lingering or self.raw is None or self.raw.is_closing():
            return
        message = (f"request not received in time: its headers and body must arrive within "
                   f"{self.read_timeout:g} s (--request-read-timeout)")
        cycle = self.cycle if self.conn.their_state is h11.SEND_BODY else None
        if cycle is not None and not cycle.response_complete:
            # Headers in, body late: the app is waiting on it. It sees a disconnect (its
            # answer, if it still makes one, goes nowhere) and the client a 408.
            started = cycle.response_started
            cycle.disconnected = True
            cycle.message_event.set()
            if not started:
                self._answer(408, message)
        elif self._partial_request():
            # Headers never completed: h11 has no request to answer, so the bytes go as they are.
            body = error_bytes(message, 408)
            self.raw.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                           b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self._close_now()

    def _answer(self, status: int, message: str) -> bool:
        """Write an error response through h11, outside any ASGI cycle, announcing the close.
        False if h11 refuses (a response of ours is already under way)."""
        assert self.raw is not None
        body = error_bytes(message, status)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.raw.write(self.conn.send(event) or b"")
        except h11.LocalProtocolError:
            return False
        return True

    # ---- refusals before a request exists -------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """h11 refused what the client sent: headers too large (431), anything else (400).
        uvicorn answers in plain text and closes at once, which resets a client still
        sending; here the answer is OpenAI's error body and the close lingers."""
        limit = self.config.h11_max_incomplete_event_size or MAX_HEADER_BYTES
        if len(self.conn.trailing_data[0]) > limit:
            answered = self._answer(431, f"request headers: larger than {limit} bytes")
        else:
            answered = self._answer(400, f"request: {msg}")
        if answered:
            self.close_lingering()
        else:
            self._close_now()

    # ---- closing --------------------------------------------------------------------------
    def close_lingering(self) -> None:
        """Close after our answer. If the client may still be sending (a body we refused,
        headers h11 gave up on), shut our side, then drain and drop its bytes until it
        closes or LINGER_S pass: closing with unread data would reset the connection and
        the client would likely never read the answer."""
        if self.lingering or self.raw is None or self.raw.is_closing():
            return
        self._disarm()
        if self.conn.their_state not in (h11.SEND_BODY, h11.ERROR) and not self._partial_request():
            self._close_now()
            return
        self.lingering = True
        self.raw.resume_reading()
        if self.raw.can_write_eof():
            self.raw.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, self._close_now)

    def _close_now(self) -> None:
        self._disarm()
        if self.raw is not None and not self.raw.is_closing():
            self.raw.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_send_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)


def protocol_class(read_timeout: float, send_timeout: float | None = None) -> type[ReadDeadlineH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with this server's read deadline and
    send deadline (None: none)."""
    return type("PdserveH11Protocol", (ReadDeadlineH11Protocol,),
                {"read_timeout": read_timeout, "send_timeout": send_timeout})
