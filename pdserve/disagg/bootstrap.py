"""The bootstrap server: a registry of a prefill server's ranks, nothing per request.

It runs in a thread of the prefill server's rank-0 scheduler process, on
``--disaggregation-bootstrap-port``.  Each prefill TP rank ``PUT``s its
``RankInfo`` (address, transfer session, compatibility record, KV layout);
decode ranks ``GET`` the list once, then talk to the ranks directly.

    PUT /ranks   body: a RankInfo message            -> 200 | 400 {"error": ...}
    GET /ranks   -> {"tp_size": n, "ranks": [RankInfo message bodies]}  (503 until all registered)
    GET /health  -> 200

Standard library HTTP in a daemon thread: one request at a time is plenty for
a registry, and a handler error answers that request instead of killing the
thread.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pdserve.disagg import protocol

logger = logging.getLogger(__name__)


class BootstrapError(RuntimeError):
    pass


class BootstrapServer:
    def __init__(self, host: str, port: int) -> None:
        self._ranks: dict[int, protocol.RankInfo] = {}
        self._lock = threading.Lock()
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:  # quiet: requests are not news
                logger.debug("bootstrap: " + fmt, *args)

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                try:
                    if self.path == "/health":
                        self._reply(200, {"ok": True})
                    elif self.path == "/ranks":
                        self._reply(*registry.listing())
                    else:
                        self._reply(404, {"error": f"no route {self.path}"})
                except Exception as exc:  # never let the server thread die
                    logger.exception("bootstrap GET %s failed", self.path)
                    self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})

            def do_PUT(self) -> None:  # noqa: N802
                try:
                    if self.path != "/ranks":
                        self._reply(404, {"error": f"no route {self.path}"})
                        return
                    n = int(self.headers.get("Content-Length") or 0)
                    msg = protocol.decode(self.rfile.read(n))
                    if not isinstance(msg, protocol.RankInfo):
                        raise protocol.ProtocolError(f"expected RankInfo, got {type(msg).__name__}")
                    registry.register(msg)
                    self._reply(200, {"ok": True})
                except (protocol.ProtocolError, BootstrapError, ValueError) as exc:
                    self._reply(400, {"error": str(exc)})
                except Exception as exc:
                    logger.exception("bootstrap PUT failed")
                    self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})

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


def register_rank(bootstrap_url: str, info: protocol.RankInfo, timeout_s: float = 10.0) -> None:
    """Register a prefill rank; retried until ``timeout_s`` while the registry is not
    up yet (rank 0 starts it once its model is loaded, other ranks may be quicker)."""
    req = urllib.request.Request(bootstrap_url.rstrip("/") + "/ranks", data=protocol.encode(info), method="PUT",
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


def fetch_ranks(bootstrap_url: str, deadline_s: float) -> list[protocol.RankInfo]:
    """The prefill ranks, waiting (polling) until all registered or the deadline passes."""
    end = time.monotonic() + deadline_s
    last = "no answer"
    while True:
        try:
            with urllib.request.urlopen(bootstrap_url.rstrip("/") + "/ranks", timeout=5.0) as r:
                body = json.loads(r.read())
            return [protocol.from_body(protocol.RankInfo, b) for b in body["ranks"]]
        except urllib.error.HTTPError as exc:
            last = exc.read().decode(errors="replace")
        except OSError as exc:
            last = str(exc)
        if time.monotonic() >= end:
            raise BootstrapError(f"bootstrap server {bootstrap_url} did not list the prefill ranks within "
                                 f"{deadline_s:g} s: {last}")
        time.sleep(0.1)
