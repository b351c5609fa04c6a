"""An ASGI app served by uvicorn in a thread on a loopback port, for tests of the HTTP
connection layer (pdserve's protocol class) without a whole server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator

import uvicorn


@contextlib.contextmanager
def serve_in_thread(app: Any, **config: Any) -> Iterator[int]:
    """Serve ``app`` on a free loopback port (uvicorn.Config options ``config``); yields
    the port once the server has started, and stops it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", timeout_graceful_shutdown=0.5, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "test server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
