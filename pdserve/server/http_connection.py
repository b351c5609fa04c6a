"""The connection under the routes: uvicorn's h11 protocol with the limits a slow, idle or
oversized client meets before any request is parsed (given to `uvicorn.Config(http=...)`
through `protocol_class`).

- A request's headers and body must arrive within `--request-read-timeout` of its first
  byte (of the connection, for a fresh one); otherwise the connection is closed, after a
  408 when the client had started a request. Headers above `MAX_HEADER_BYTES` get a 431.
- A connection closed while the client is still sending (a 413, a 431) is closed
  "lingering": the answer is written, our side shut, and what the client still sends is
  read and dropped for up to `LINGER_S`, so that it reads the answer instead of a reset.
- A client that takes none of what is sent to it for `--send-timeout` seconds (the
  transport's buffer full, so the response waits on it) is dropped: the connection is
  aborted and the route sees the client gone (a stream's request is aborted, its KV freed).
- A connection that opens with HTTP/2's preface (prior knowledge: SGLang's router probes
  every worker for gRPC that way at startup) is told, in HTTP/2, to use HTTP/1.1 (SETTINGS,
  then GOAWAY HTTP_1_1_REQUIRED) and closed, quietly: h11 would take the preface for a
  request "PRI * HTTP/2.0" (a 404 in the access log) and the rest for garbage ("Invalid
  HTTP request received" at warning level). Any other malformed request still warns.

Split from http_front.py, which keeps the ASGI middleware (keys, body size) and the
error bodies: this module works on the transport and h11's state, below ASGI, and is
what the servers and the router hand uvicorn; the middleware is what they wrap their
apps in. Every refusal here is OpenAI's error body too (`http_front.error_bytes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import sys
import termios
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from pdserve.server.http_front import error_bytes

MAX_HEADER_BYTES = 64 * 1024   # request line + headers; above: 431
LINGER_S = 2.0                 # how long a closing connection drains what the client still sends
# RFC 9113 section 3.4: what an HTTP/2 client with prior knowledge sends first; the answer,
# an empty SETTINGS frame (the server's preface) and GOAWAY(last stream 0, HTTP_1_1_REQUIRED).
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_USE_HTTP1 = (b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
                b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + (0).to_bytes(4, "big") + (0xD).to_bytes(4, "big"))
logger = logging.getLogger(__name__)
# ioctl request for a socket's unsent + unacknowledged bytes (Linux's SIOCOUTQ, which is
# TIOCOUTQ's number); None elsewhere: only our own buffer is watched there.
_SIOCOUTQ: int | None = getattr(termios, "TIOCOUTQ", None) if sys.platform == "linux" else None


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
        # The connection's first bytes while they may still be HTTP/2's preface (None: not).
        self._opening: bytes | None = b""

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
        if self._opening is not None:
            data = self._http2_preface(data)
            if not data:
                return
        super().data_received(data)
        # A request being received runs against its deadline, armed at its first byte; once
        # it is all in (or between requests, where uvicorn's keep-alive timeout applies) none.
        if self.conn.their_state is h11.SEND_BODY or self._partial_request():
            self._arm()
        else:
            self._disarm()

    def _http2_preface(self, data: bytes) -> bytes:
        """The connection's opening bytes for h11 once they cannot be HTTP/2's preface
        (all of them, held back so far); b"" while they still may be, or once they were
        (then answered and closed; see the module doc)."""
        assert self._opening is not None and self.raw is not None
        opening = self._opening + data
        if H2_PREFACE.startswith(opening[:len(H2_PREFACE)]):
            if len(opening) < len(H2_PREFACE):
                self._opening = opening  # (the read deadline armed at connect still runs)
                return b""
            self._opening = None
            self.raw.write(H2_USE_HTTP1)
            self.lingering = True  # whatever else the client sends (its SETTINGS...) is dropped
            self._close_now()
            return b""
        self._opening = None
        return opening

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
