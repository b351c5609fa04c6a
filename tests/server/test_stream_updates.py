"""Issue 39, finding 7, the parts that need no model: a slow stream's pending updates are
merged (one per sample, never a queue growing with every step), a stream counts toward
the queue limit until its consumer is done with it, and the HTTP front drops a client
that takes nothing for --send-timeout while keeping one that reads slowly.

The same behaviour against real server processes: tests/security/test_stream_backpressure.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from pdserve.config import ConfigError, ServerArgs
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.messages import NewRequest
from pdserve.server import ipc
from pdserve.server.drain import QueueLimit, Refused
from pdserve.server.http_connection import protocol_class
from pdserve.server.messages import TextUpdate, TokenUpdate
from pdserve.server.metrics import ServerMetrics
from pdserve.server.tokenizer_manager import RequestState, SampleResult, TokenizerManager, Updates
from tests.server.uvicorn_thread import serve_in_thread

LENGTH = {"type": "length", "length": 3}


def update(rid: str, index: int, ids: tuple[int, ...], text: str, *, finish: dict | None = None,
           params: SamplingParams | None = None, input_lps: tuple | None = None) -> TextUpdate:
    """An update of sample `index` of `rid` with one logprob and one top entry per token."""
    return TextUpdate(TokenUpdate(
        rid=rid, index=index, new_ids=ids, new_logprobs=tuple(-float(t) for t in ids),
        new_top_logprobs=tuple(((-float(t), t),) for t in ids), finish=finish, prompt_tokens=2,
        cached_tokens=0, completion_tokens=len(text), retractions=0, spec_verify_ct=0, spec_accepted_drafts=0,
        params=params, input_logprobs=input_lps, input_top_logprobs=None if input_lps is None else ((),) * 2),
        text)


def state(rid: str, n: int) -> RequestState:
    return RequestState(rid, [1, 2], SamplingParams(n=n), [SampleResult(i) for i in range(n)], Updates())


# ---- the merged queue -------------------------------------------------------------------
def test_pending_updates_of_a_sample_merge_into_one():
    async def run() -> None:
        q, st = Updates(), state("r", 2)
        params = SamplingParams(n=2, max_new_tokens=3)
        first = update("r", 0, (7,), "a", params=params, input_lps=(None, -0.5))
        q.put_nowait((st, first))
        q.put_nowait((st, update("r", 1, (9,), "z")))
        q.put_nowait((st, update("r", 0, (8, 6), "bc")))
        q.put_nowait((st, update("r", 0, (5,), "d", finish=LENGTH)))
        # A consumer that took nothing holds one update per sample, however many steps ran.
        assert q.qsize() == 2
        got_state, merged = await q.get()
        assert got_state is st
        tok = merged.token
        assert (tok.index, merged.text_delta, tok.new_ids) == (0, "abcd", (7, 8, 6, 5))
        assert tok.new_logprobs == (-7.0, -8.0, -6.0, -5.0)
        assert tok.new_top_logprobs == (((-7.0, 7),), ((-8.0, 8),), ((-6.0, 6),), ((-5.0, 5),))
        # The latest counters and finish, the first update's once-only fields.
        assert tok.finish == LENGTH and tok.completion_tokens == 1
        assert tok.params is params and tok.input_logprobs == (None, -0.5) and tok.input_top_logprobs == ((), ())
        _, other = await q.get()
        assert (other.token.index, other.text_delta, other.token.new_ids) == (1, "z", (9,))
        assert q.qsize() == 0
        # A lone update is handed on as it came.
        q.put_nowait((st, first))
        assert (await q.get())[1] is first
    asyncio.run(run())


def test_a_failure_comes_after_what_is_pending_and_wakes_a_waiting_consumer():
    async def run() -> None:
        q, st = Updates(), state("r", 1)
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        assert not waiting.done()
        q.put_nowait((st, update("r", 0, (3,), "x")))
        assert (await asyncio.wait_for(waiting, 5))[1].text_delta == "x"
        q.put_nowait((st, update("r", 0, (4,), "y")))
        q.put_nowait("server process died")
        q.put_nowait("a second failure is not queued")
        assert q.qsize() == 2
        assert (await q.get())[1].text_delta == "y"
        assert await q.get() == "server process died"
    asyncio.run(run())


# ---- counting a stream until it is delivered ------------------------------------------------
@contextlib.asynccontextmanager
async def manager(max_running: int, max_queued: int) -> Any:
    """A TokenizerManager with no processes behind it (what it sends the scheduler queues
    in its socket); updates are fed to it with `_route`, as its receive loop would."""
    paths = ipc.IpcPaths.create()
    m = TokenizerManager(SimpleNamespace(tokenizer=None), paths, ServerMetrics(), [])  # type: ignore[arg-type]
    m.queue_limit = QueueLimit(max_queued, max_running)
    try:
        yield m
    finally:
        await m.close()
        paths.cleanup()


def new_request(rid: str, n: int) -> NewRequest:
    return NewRequest(rid, (1, 2), SamplingParams(n=n, max_new_tokens=3), seeds=tuple(range(n)))


def test_a_stream_counts_toward_the_queue_until_its_consumer_is_done():
    async def run() -> None:
        async with manager(max_running=2, max_queued=0) as m:
            job = await m.submit([new_request("a", 2)])
            assert m.in_flight_samples() == 2
            stream = m.stream(job)
            m._route(update("a", 0, (5,), "x"), time.perf_counter())
            assert (await stream.__anext__())[1].text_delta == "x"  # the consumer took one, then stalls
            m._route(update("a", 0, (6,), "y", finish=LENGTH), 0.0)
            m._route(update("a", 1, (7,), "z", finish=LENGTH), 0.0)
            # The scheduler is done with it, its client has not taken its end: still counted.
            assert "a" not in m.requests
            assert m.in_flight_samples() == 2
            with pytest.raises(Refused, match="--max-queued-requests 0"):
                await m.submit([new_request("b", 1)])
            assert [u.text_delta async for _, u in stream] == ["y", "z"]
            assert m.in_flight_samples() == 0
            await m.submit([new_request("b", 1)])

            # A consumer that stops early (its client went away) stops counting at once.
            job = await m.submit([new_request("c", 1)])
            stream = m.stream(job)
            m._route(update("c", 0, (5,), "x"), 0.0)
            await stream.__anext__()
            assert m.in_flight_samples() == 2  # b and c, both running
            await stream.aclose()
            assert m.in_flight_samples() == 2  # c holds its slot until its abort is confirmed
            m._route(update("c", 0, (), "", finish={"type": "abort", "message": "aborted by the client"}), 0.0)
            assert m.in_flight_samples() == 1
    asyncio.run(run())


def test_a_rid_reused_while_its_first_stream_is_delivered_is_counted_twice():
    async def run() -> None:
        async with manager(max_running=4, max_queued=0) as m:
            job = await m.submit([new_request("a", 1)])
            stream = m.stream(job)
            m._route(update("a", 0, (5,), "x", finish=LENGTH), 0.0)
            await stream.__anext__()
            await m.submit([new_request("a", 2)])  # the rid is free once the scheduler is done
            assert m.in_flight_samples() == 3
            await stream.aclose()
            assert m.in_flight_samples() == 2
    asyncio.run(run())


def test_send_timeout_flag():
    assert ServerArgs().send_timeout == 60.0
    assert ServerArgs.from_cli(["--send-timeout", "0.5"]).send_timeout == 0.5
    for value in ("0", "-1", "inf", "nan"):
        with pytest.raises(ConfigError, match="--send-timeout"):
            ServerArgs.from_cli(["--send-timeout", value])


# ---- the HTTP front's send deadline -------------------------------------------------------
SEND_TIMEOUT = 0.5
CHUNK = b"x" * 65536


class Endless:
    """An ASGI app streaming 64 KiB chunks until its client is gone; records how it ended."""

    def __init__(self) -> None:
        self.ended: list[str] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await receive()  # the (empty) body
        gone = asyncio.ensure_future(self._disconnect(receive))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        try:
            while not gone.done():
                await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            self.ended.append("client gone")
        finally:
            gone.cancel()

    @staticmethod
    async def _disconnect(receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass


@pytest.fixture(scope="module")
def endless() -> Iterator[tuple[int, Endless]]:
    app = Endless()
    with serve_in_thread(app, log_level="error", access_log=False, http=protocol_class(10.0, SEND_TIMEOUT)) as port:
        yield port, app


def open_stream(port: int) -> socket.socket:
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.connect(("127.0.0.1", port))
    c.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    return c


TCP_ESTABLISHED = 1  # tcp_info.tcpi_state (Linux)


def still_open(c: socket.socket) -> bool:
    """Whether the server has neither reset nor closed the connection, seen without reading
    (reading would be taking some of the response)."""
    return c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == TCP_ESTABLISHED


def closed_within(c: socket.socket, limit: float) -> float:
    """Seconds until the server closed (or reset) the connection of a client that reads nothing."""
    t0 = time.monotonic()
    while still_open(c):
        if time.monotonic() - t0 > limit:
            raise AssertionError(f"connection still open after {limit} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_client_that_takes_nothing_is_reset_after_the_send_timeout(endless):
    port, app = endless
    before = len(app.ended)
    with open_stream(port) as c:
        took = closed_within(c, 15.0)
        with pytest.raises(ConnectionResetError):  # a reset: the unsent rest was dropped
            while c.recv(1 << 20):
                pass
    # Buffers fill (megabytes on loopback) before the deadline starts: well under a second here.
    assert took >= SEND_TIMEOUT
    deadline = time.monotonic() + 5
    while len(app.ended) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert app.ended[before:] == ["client gone"]  # the app saw the disconnect and stopped


def test_a_client_that_reads_slowly_is_not_dropped(endless):
    port, _ = endless
    with open_stream(port) as c:
        c.settimeout(5)
        got, t0 = 0, time.monotonic()
        # 4 KiB every 0.1 s: far slower than the app writes, so the server's buffers stay
        # full and its writes paused, for 6 send timeouts.
        while time.monotonic() - t0 < 6 * SEND_TIMEOUT:
            chunk = c.recv(4096)
            assert chunk, "the server closed the connection of a client that reads"
            got += len(chunk)
            time.sleep(0.1)
        assert got > 0
