"""SGLang's router probes every worker for gRPC at startup: it opens the connection with
HTTP/2's preface. The servers' (and pdserve's router's) connection protocol answers it in
HTTP/2 ("use HTTP/1.1": SETTINGS, then GOAWAY HTTP_1_1_REQUIRED) and closes, without the
`"PRI * HTTP/2.0" 404` access line and the "Invalid HTTP request received" warning that
h11 alone would log; a malformed HTTP/1 request still warns, and HTTP/1 requests whose
first bytes look like the preface's ("P...") are served."""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import time
from typing import Any, Iterator

import pytest

from pdserve.server.http_connection import H2_PREFACE, protocol_class
from tests.server.uvicorn_thread import serve_in_thread

pytestmark = pytest.mark.fast


class App:
    """Answers every request with 200 "ok" and counts them."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        self.calls += 1
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def served() -> Iterator[tuple[int, App]]:
    app = App()
    with serve_in_thread(app, log_level="info", http=protocol_class(5.0)) as port:
        yield port, app


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def logged() -> Iterator[Recorder]:
    """Every record of the uvicorn loggers and the root, seen by a handler of the test's
    own on each: caplog reaches a non-propagating logger (uvicorn's) only when it was one
    as the test phase began, which an earlier test in the same process can change."""
    recorder = Recorder()
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.access")]
    for one in loggers:
        one.addHandler(recorder)
    try:
        yield recorder
    finally:
        for one in loggers:
            one.removeHandler(recorder)


def exchange(port: int, *pieces: bytes) -> bytes:
    """Send `pieces` (a pause between them), then read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        for i, piece in enumerate(pieces):
            if i:
                time.sleep(0.05)
            c.sendall(piece)
        out = b""
        while chunk := c.recv(65536):
            out += chunk
        return out


def frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """HTTP/2 frames: (type, stream id, payload)."""
    out = []
    while data:
        length, kind = int.from_bytes(data[:3], "big"), data[3]  # (data[4]: the flags)
        stream = struct.unpack(">I", data[5:9])[0] & 0x7FFFFFFF
        out.append((kind, stream, data[9:9 + length]))
        data = data[9 + length:]
    return out


SETTINGS, GOAWAY, HTTP_1_1_REQUIRED = 0x4, 0x7, 0xD
# What an HTTP/2 client sends first: the preface, then its SETTINGS frame.
CLIENT_OPENING = H2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def test_http2_preface_is_answered_in_http2_and_quietly(served):
    port, app = served
    with logged() as recorder:
        for pieces in ([CLIENT_OPENING], [H2_PREFACE[:3], H2_PREFACE[3:10], H2_PREFACE[10:]],
                       [bytes([b]) for b in H2_PREFACE]):
            answer = frames(exchange(port, *pieces))
            assert [(kind, stream) for kind, stream, _ in answer] == [(SETTINGS, 0), (GOAWAY, 0)], answer
            last_stream, error = struct.unpack(">II", answer[1][2])
            assert (last_stream, error) == (0, HTTP_1_1_REQUIRED)
        # The recorder does see the access log (so the silence above is the protocol's).
        assert exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").startswith(b"HTTP/1.1 200")
    assert app.calls == 1
    messages = [r.getMessage() for r in recorder.records]
    assert [m for m in messages if "GET / HTTP/1.1" in m and "200" in m], messages
    assert not [m for m in messages if "PRI" in m or "Invalid HTTP" in m or r"HTTP/2" in m], messages
    # The server still serves HTTP/1.1, requests starting with the preface's "P" too.
    assert exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").startswith(b"HTTP/1.1 200")
    assert exchange(port, b"P", b"OST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    ).startswith(b"HTTP/1.1 200")
    assert app.calls == 3


def test_other_malformed_requests_still_warn(served):
    port, app = served
    with logged() as recorder:
        answer = exchange(port, b"PRX * HTTP/1.1 garbage\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert any("Invalid HTTP request received" in r.getMessage() and r.levelno == logging.WARNING
               for r in recorder.records), recorder.records
    assert app.calls == 0
