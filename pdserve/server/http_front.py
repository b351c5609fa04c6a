"""What stands between a client and the routes, at the ASGI level: the keys and the body
size limit a request meets before it is parsed, and the error body of every refusal.

- `KeyCheck` (ASGI): `--api-key` on every route but /health, `--admin-api-key` on the
  admin routes (without one, the admin routes answer loopback clients only); keys
  compared in constant time.
- `BodyLimit` (ASGI): a body above `--max-request-bytes` gets a 413 before it is parsed,
  whether it announced its length (Content-Length) or not (chunked).

The connection below them (read and send deadlines, header size, lingering closes) is
http_connection.py's: it works on the transport and h11's state, not on ASGI messages.

Every refusal is OpenAI's error body (`http_common.error_body`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any, Awaitable, Callable, Collection, MutableMapping

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def error_body(message: str, kind: str, param: str | None, code: int | str) -> dict[str, Any]:
    """OpenAI's error shape, used by every route (SGLang's router expects it too)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


ADMIN_PATHS = frozenset({"/abort_request", "/flush_cache", "/drain"})
# No key needed (load balancers, orchestrators' probes; the last two: the router's).
OPEN_PATHS = frozenset({"/health", "/readiness", "/liveness"})


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
