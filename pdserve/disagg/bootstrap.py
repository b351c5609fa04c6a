"""The bootstrap server: a registry of a prefill server's ranks, nothing per request.

It runs in a thread of the prefill server's rank-0 scheduler process, on
``--disaggregation-bootstrap-port``.  Each prefill TP rank ``PUT``s its
``RankInfo`` (address, transfer session, compatibility record, KV layout);
decode ranks ``GET`` the list once, then talk to the ranks directly.

    PUT /ranks   body: a RankInfo message            -> 200 | 400 {"error": ...}
    GET /ranks   -> {"tp_size": n, "ranks": [RankInfo message bodies]}  (503 until all registered)
    GET /health  -> 200 {"ok": true, "id": IDENTITY}

Signed requests name the registry as their recipient: a registration is signed for
``REGISTRY_RECIPIENT`` (with a key no other server holds); a listing request for the
server's ``identity``, drawn at its start and told by ``GET /health``, so a listing
request captured on one prefill server is refused by every other one.

Standard library HTTP in a daemon thread: one request at a time is plenty for
a registry, and a handler error answers that request instead of killing the
thread. Only the server's own ranks can register: a registration must be signed
with a key rank 0 drew at startup and shared with its ranks alone. With a
deployment secret, listing the ranks (their transfer sessions and buffer
addresses) needs a request signed with it (header ``X-Pdserve-Auth``). Every
malformed request gets a 4xx and its connection closed; a client that stalls is
dropped after a few seconds.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

from pdserve.disagg import protocol

logger = logging.getLogger(__name__)


class BootstrapError(RuntimeError):
    pass


MAX_BODY_BYTES = 1 << 20     # a RankInfo is a few KB (100 KB with hundreds of KV buffers)
MAX_AUTH_BYTES = 4096        # the X-Pdserve-Auth header: a signed Heartbeat of ~300 bytes
CLIENT_TIMEOUT_S = 5.0       # a request must arrive within this
AUTH_HEADER = "X-Pdserve-Auth"
REGISTRY_RECIPIENT = "pdserve-bootstrap-registry"   # the ``to`` of a rank's registration


class BootstrapServer:
    def __init__(self, host: str, port: int, registry_auth: protocol.Authenticator,
                 listing_auth: protocol.Authenticator | None = None) -> None:
        """``registry_auth``: the key the server's own ranks sign registrations with;
        ``listing_auth``: the deployment secret that GET /ranks must be signed with
        (None: the listing is open, as the server listens on loopback only)."""
        self._ranks: dict[int, protocol.RankInfo] = {}
        self._lock = threading.Lock()
        self.refused = 0
        # The recipient a listing request must be signed for: this server, and only it.
        self.identity = f"pdserve-bootstrap-{secrets.token_hex(8)}"
        registry = self

        class Handler(BaseHTTPRequestHandler):
            timeout = CLIENT_TIMEOUT_S  # the socket's: a stalled read ends the connection

            def log_message(self, fmt: str, *args: Any) -> None:  # quiet: requests are not news
                logger.debug("bootstrap: " + fmt, *args)

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                if status >= 400:
                    self.close_connection = True
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status >= 400:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)

            def _refuse(self, status: int, why: str) -> None:
                with registry._lock:
                    registry.refused += 1
                self._reply(status, {"error": why})

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                try:
                    if self.path == "/health":
                        self._reply(200, {"ok": True, "id": registry.identity})
                    elif self.path != "/ranks":
                        self._reply(404, {"error": "no such route"})
                    elif listing_auth is not None and not self._signed_by(listing_auth):
                        self._refuse(401, f"listing the ranks needs a request signed with the deployment's "
                                          f"--disaggregation-secret ({AUTH_HEADER})")
                    else:
                        self._reply(*registry.listing())
                except Exception:  # never let the server thread die
                    logger.exception("bootstrap GET failed")
                    self._reply(500, {"error": "internal error"})

            def _signed_by(self, auth: protocol.Authenticator) -> bool:
                try:
                    protocol.decode(self.headers.get(AUTH_HEADER, "").encode("latin-1"), auth,
                                    recipient=registry.identity, max_bytes=MAX_AUTH_BYTES)
                    return True
                except (protocol.ProtocolError, UnicodeEncodeError):
                    return False

            def do_PUT(self) -> None:  # noqa: N802
                try:
                    if self.path != "/ranks":
                        self._reply(404, {"error": "no such route"})
                        return
                    length = self.headers.get("Content-Length", "")
                    if not length.isdigit():
                        self._refuse(400, "Content-Length: a non-negative integer is required")
                        return
                    if int(length) > MAX_BODY_BYTES:
                        self._refuse(413, f"body above {MAX_BODY_BYTES} bytes")
                        return
                    try:
                        msg = protocol.decode(self.rfile.read(int(length)), registry_auth,
                                              recipient=REGISTRY_RECIPIENT, max_bytes=MAX_BODY_BYTES)
                    except protocol.AuthError:
                        self._refuse(403, "only this prefill server's own ranks may register")
                        return
                    if not isinstance(msg, protocol.RankInfo):
                        raise protocol.ProtocolError(f"expected RankInfo, got {type(msg).__name__}")
                    registry.register(msg)
                    self._reply(200, {"ok": True})
                except (protocol.ProtocolError, BootstrapError, ValueError) as exc:
                    self._refuse(400, str(exc))
                except OSError:  # the client went away or stalled past the timeout
                    self.close_connection = True
                except Exception:
                    logger.exception("bootstrap PUT failed")
                    self._reply(500, {"error": "internal error"})

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="bootstrap", daemon=True)
        self._thread.start()

    def register(self, info: protocol.RankInfo) -> None:
        with self._lock:
            known = next(iter(self._ranks.values()), None)
            if known is not None and known.tp_size != info.tp_size:
                raise BootstrapError(f"rank {info.tp_rank} registers tp_size {info.tp_size}, "
                                     f"others registered {known.tp_size}")
            if not 0 <= info.tp_rank < info.tp_size:
                raise BootstrapError(f"tp_rank {info.tp_rank} outside tp_size {info.tp_size}")
            self._ranks[info.tp_rank] = info

    def listing(self) -> tuple[int, dict[str, Any]]:
        with self._lock:
            ranks = [self._ranks[k] for k in sorted(self._ranks)]
        if not ranks or len(ranks) != ranks[0].tp_size:
            have = len(ranks)
            want = ranks[0].tp_size if ranks else "?"
            return 503, {"error": f"prefill ranks not all registered yet ({have} of {want})"}
        return 200, {"tp_size": ranks[0].tp_size,
                     "ranks": [protocol.to_body(r) for r in ranks]}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


_HOST_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def bootstrap_url(host: object, port: object, allowed: Sequence[str] = ()) -> str:
    """The URL of the prefill bootstrap server a request names, or ValueError naming the
    field. The address comes from a client: only a hostname or an IP literal and a port
    number pass (no path, userinfo or fragment can ride along), and with an allow-list
    (``HOST`` or ``HOST:PORT`` entries) only the servers it names."""
    if not isinstance(host, str) or not host:
        raise ValueError("bootstrap_host: must be a hostname or an IP address")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
        if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in host.rstrip(".").split(".")):
            raise ValueError(f"bootstrap_host: {host[:80]!r} is not a hostname or an IP address") from None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port <= 65535:
        raise ValueError(f"bootstrap_port: must be an integer in [1, 65535], got {port!r}")
    if allowed and host not in allowed and f"{host}:{port}" not in allowed:
        raise ValueError(f"bootstrap_host: {host}:{port} is not among this server's "
                         "--disaggregation-allowed-prefill")
    return f"http://[{host}]:{port}" if ip is not None and ip.version == 6 else f"http://{host}:{port}"


def reachable_host(host: str) -> str:
    """The address peers use to reach a server bound to ``host``: itself, unless it is a
    wildcard (0.0.0.0 in a container), then this machine's address by its hostname
    (what a compose network resolves), falling back to loopback."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def register_rank(bootstrap_url: str, info: protocol.RankInfo, auth: protocol.Authenticator,
                  timeout_s: float = 10.0) -> None:
    """Register a prefill rank (signed with the registry key its rank 0 shared); retried
    until ``timeout_s`` while the registry is not up yet (rank 0 starts it once its
    model is loaded, other ranks may be quicker)."""
    req = urllib.request.Request(bootstrap_url.rstrip("/") + "/ranks",
                                 data=protocol.encode(info, auth, to=REGISTRY_RECIPIENT), method="PUT",
                                 headers={"Content-Type": "application/json"})
    end = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                r.read()
            return
        except urllib.error.HTTPError as exc:
            raise BootstrapError(f"bootstrap server {bootstrap_url} refused rank {info.tp_rank}: "
                                 f"{exc.read().decode(errors='replace')}") from None
        except OSError as exc:
            if time.monotonic() >= end:
                raise BootstrapError(f"bootstrap server {bootstrap_url} unreachable: {exc}") from None
            time.sleep(0.1)


def _identity(bootstrap_url: str) -> str:
    """The identity a bootstrap server names in GET /health: the recipient its listing
    requests are signed for (a server without one ignores the signature anyway)."""
    with urllib.request.urlopen(bootstrap_url.rstrip("/") + "/health", timeout=5.0) as r:
        health = json.loads(r.read(4096))
    ident = health.get("id") if isinstance(health, dict) else None
    return ident if isinstance(ident, str) and ident else "pdserve-bootstrap"


def fetch_ranks(bootstrap_url: str, deadline_s: float, auth: protocol.Authenticator | None = None
                ) -> list[protocol.RankInfo]:
    """The prefill ranks, waiting (polling) until all registered or the deadline passes.
    The remote server's own words never reach the caller (the address came from a
    client): only its status, or that its answer was not a rank list."""
    end = time.monotonic() + deadline_s
    last = "no answer"
    pause = 0.05
    while True:
        try:
            headers = {AUTH_HEADER: protocol.encode(protocol.Heartbeat(auth.identity), auth,
                                                    to=_identity(bootstrap_url)).decode()} if auth else {}
            req = urllib.request.Request(bootstrap_url.rstrip("/") + "/ranks", headers=headers)
            with urllib.request.urlopen(req, timeout=5.0) as r:
                body = json.loads(r.read(MAX_BODY_BYTES * 8))
            return [protocol.from_body(protocol.RankInfo, b) for b in body["ranks"]]
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}" + (" (not all prefill ranks registered yet)" if exc.code == 503 else
                                         " (do both servers use the same --disaggregation-secret?)"
                                         if exc.code == 401 else "")
            if exc.code not in (503,):
                raise BootstrapError(f"bootstrap server {bootstrap_url} refused the rank listing: {last}") from None
        except (ValueError, KeyError, TypeError, protocol.ProtocolError):
            raise BootstrapError(f"{bootstrap_url} did not answer with a prefill rank list") from None
        except OSError as exc:
            last = type(exc).__name__ if not isinstance(exc, urllib.error.URLError) else str(exc.reason)
        if time.monotonic() >= end:
            raise BootstrapError(f"bootstrap server {bootstrap_url} did not list the prefill ranks within "
                                 f"{deadline_s:g} s: {last}")
        pause = min(2.0, pause * 2)  # back off: a server that is not there is not polled ten times a second
        time.sleep(min(pause, max(0.0, end - time.monotonic())))
