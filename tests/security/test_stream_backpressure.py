"""Issue 39, findings 7 and 8, replayed against real processes on the demo model.

- 7: clients that open a stream and never read it (a raw socket with a 4 KiB receive
  buffer) are dropped --send-timeout after their connection's buffers filled: each
  request ends once (aborted), its KV and slots come back, the HTTP process does not grow
  while they sit unread, and while a stream is still being delivered (its generation
  over, its client reading slowly) it counts toward --max-queued-requests: another
  request gets the documented 503. A stream whose client pauses gets the same text and
  logprobs as a non-streamed request, in fewer (merged) events.
- 8: a request with more samples (prompts x n) than the server can run plus queue is a
  400 naming --max-running-requests and --max-queued-requests, from the server and, passed
  through unchanged, from a router in front of it.

After each attack a normal request gets the answer it got before.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

import pdserve.assets
from tests.router.conftest import RouterProcess
from tests.security.test_http_front import http_process_rss_mb
from tests.security.served import Target
from tests.server.conftest import ServerProcess, assert_openai_error, parse_sse_lines
from tests.server.test_stream_updates import closed_within, still_open
from tests.waiting import wait_until

SEND_TIMEOUT = 2.0     # the server's --send-timeout
MAX_RUNNING = 4
# Generous bounds for a loaded 2-core machine: how long until a connection's buffers fill
# (megabytes on loopback) and its deadline runs out; how much the HTTP process may grow.
DROP_WITHIN_S = 60.0
RSS_GROWTH_RATIO = 1.25
PROMPT = "hello world " * 50           # 600 tokens of the demo's tokenizer
# SGLang's native stream repeats the whole result so far in every event: with the prompt's
# top logprobs that is ~130 KB an event, the heaviest stream a client can ask for.
HEAVY = {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5, "stream": True}
NORMAL = {"text": "abc", "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}}


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    s = ServerProcess(pdserve.assets.path("demo"), "--max-running-requests", str(MAX_RUNNING),
                      "--max-queued-requests", "0", "--send-timeout", str(SEND_TIMEOUT))
    try:
        yield Target(s, NORMAL, check_pools=True)
    finally:
        s.close()


def unread_stream(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """A client that sends a request and reads nothing (a 4 KiB receive buffer)."""
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.connect(("127.0.0.1", port))
    raw = json.dumps(body).encode()
    c.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
              % (path.encode(), len(raw), raw))
    return c


class Trickle:
    """Reads a connection slowly (4 KiB every 0.1 s, far slower than a heavy stream is
    produced, not so slow that the send deadline drops it) until `stop`; then `rest`
    reads the whole remaining response."""

    def __init__(self, c: socket.socket) -> None:
        self.c = c
        self.data = bytearray()
        self.reading = threading.Event()
        self.reading.set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.c.settimeout(1.0)
        while self.reading.is_set():
            try:
                chunk = self.c.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            if not chunk:
                return
            self.data += chunk
            time.sleep(0.1)

    def stop(self) -> None:
        self.reading.clear()
        self.thread.join(5)

    def rest(self, timeout: float = 60.0) -> bytes:
        """Everything until the end of the chunked response."""
        self.stop()
        self.c.settimeout(timeout)
        while not self.data.endswith(b"\r\n0\r\n\r\n"):
            chunk = self.c.recv(1 << 20)
            assert chunk, f"connection closed before the response ended: {bytes(self.data[-200:])!r}"
            self.data += chunk
        return bytes(self.data)


def sse_of(raw: bytes) -> list[str]:
    """The lines of a chunked (Transfer-Encoding) HTTP/1.1 response's body."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
    body = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2:]
    return body.decode().splitlines()


# ---- finding 7 ---------------------------------------------------------------------------
def test_unread_streams_are_dropped_and_their_requests_aborted(target):
    s = target.server
    before, rss_before = target.outcomes(), http_process_rss_mb(s)
    body = dict(HEAVY, sampling_params={"max_new_tokens": 1400, "ignore_eos": True, "n": 2})
    clients = [unread_stream(s.port, "/generate", body) for _ in range(2)]
    try:
        peak = rss_before
        t0 = time.monotonic()
        while any(still_open(c) for c in clients):
            assert time.monotonic() - t0 < DROP_WITHIN_S, "unread streams still open"
            peak = max(peak, http_process_rss_mb(s))
            time.sleep(0.1)
        # Their generation (1400 tokens) was far from done: the drop aborted it.
        after = wait_until(lambda: (o := target.outcomes())["abort"] == before["abort"] + 2 and o, 30,
                           what="both requests aborted")
        assert after["length"] == before["length"] and after["stop"] == before["stop"], (before, after)
        for c in clients:
            with pytest.raises(ConnectionResetError):  # reset: what the server had queued is dropped
                while c.recv(1 << 20):
                    pass
    finally:
        for c in clients:
            c.close()
    assert s.output().count("(--send-timeout)") >= 2
    # Each sat unread for SEND_TIMEOUT after its buffers filled, producing all along: the
    # HTTP process held one pending update per sample, not one per step.
    assert peak < rss_before * RSS_GROWTH_RATIO, (rss_before, peak)
    target.assert_serving()  # slots and KV all back, same answers
    # Exactly one final outcome each: nothing more was counted since.
    assert target.outcomes()["abort"] == before["abort"] + 2


def test_a_stream_being_delivered_counts_toward_the_queue_limit(target):
    s = target.server
    before = target.outcomes()
    # Short generations with large events (~0.5 MB each: more than the connection's
    # buffers can absorb, so what is left to deliver stays in this process): done long
    # before their clients take them.
    body = dict(HEAVY, text=PROMPT * 2, top_logprobs_num=20,
                sampling_params={"max_new_tokens": 24, "ignore_eos": True, "n": 2})
    clients = [unread_stream(s.port, "/generate", body) for _ in range(2)]
    readers = [Trickle(c) for c in clients]  # slow clients, which the send deadline spares
    try:
        # Both generations over (the scheduler idle), both responses still being delivered.
        wait_until(lambda: target.outcomes()["length"] == before["length"] + 2, 60, what="both generations done")
        st = s.state()
        assert (st["num_running_reqs"], st["num_waiting_reqs"]) == (0, 0), st
        assert all(still_open(c) for c in clients)
        # Their 4 samples fill the 4 running slots, and nothing may queue: a 503, at once.
        r = httpx.post(s.url + "/generate", json=NORMAL, timeout=30)
        err = assert_openai_error(r, 503)
        assert r.headers.get("retry-after") and "--max-queued-requests 0" in err["message"], (r.headers, err)
        # The clients stop reading: dropped within two deadlines (one may have just seen progress).
        for t in readers:
            t.stop()
        for c in clients:
            closed_within(c, 2 * SEND_TIMEOUT + 10)
    finally:
        for t in readers:
            t.stop()
        for c in clients:
            c.close()
    after = target.outcomes()
    assert after == dict(before, length=before["length"] + 2), (before, after)  # one outcome each
    target.assert_serving()  # the 503 is gone with them


def test_a_slow_reader_gets_the_same_result_in_merged_events(target):
    s = target.server
    body = dict(HEAVY, sampling_params={"max_new_tokens": 64, "ignore_eos": True, "temperature": 0.0})
    whole = httpx.post(s.url + "/generate", json=dict(body, stream=False), timeout=120).json()
    before = target.outcomes()
    reader = Trickle(unread_stream(s.port, "/generate", body))
    try:
        # Read slowly until the whole output is generated (the stream's sender blocked on a
        # full connection all along), then everything.
        wait_until(lambda: target.outcomes()["length"] == before["length"] + 1, 60, what="generation done")
        events, done = parse_sse_lines(sse_of(reader.rest()))
    finally:
        reader.stop()
        reader.c.close()
    assert done
    last = events[-1]
    # Fewer events than tokens: updates that came while the sender was blocked were merged.
    assert len(events) < whole["meta_info"]["completion_tokens"], len(events)
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"):
        assert same_logprobs(last["meta_info"][key], whole["meta_info"][key]), key
    target.assert_serving()


def same_logprobs(a: Any, b: Any) -> bool:
    """Nested logprob lists equal: token ids and texts exactly, values to 1e-4 (the prompt
    may have come from the prefix cache in one of the two runs)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_logprobs(x, y) for x, y in zip(a, b))
    return a == b


# ---- finding 8 ---------------------------------------------------------------------------
OVERSIZE = [  # (route, body): 6 or 5 samples against 4 slots + 0 queue places
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 4}),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 4, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 5, "max_tokens": 4}),
    ("/generate", {"text": ["a", "b", "c"], "sampling_params": {"n": 2, "max_new_tokens": 4}}),
]


def assert_too_many_samples(r: httpx.Response, samples: int) -> dict[str, Any]:
    err = assert_openai_error(r, 400, fields=("n",))
    assert err["param"] == "n", err
    for words in (f"{samples} samples", f"{MAX_RUNNING} running (--max-running-requests)",
                  "0 queued (--max-queued-requests)"):
        assert words in err["message"], err
    return err


def samples(route: str, body: dict[str, Any]) -> int:
    prompts = body.get("prompt", body.get("text", ["chat"]))
    n = body["sampling_params"]["n"] if route == "/generate" else body["n"]
    return len(prompts) * n


@pytest.mark.parametrize("route, body", OVERSIZE)
def test_a_request_larger_than_the_server_can_hold_is_400_on_the_server(target, route, body):
    before = target.outcomes()
    assert_too_many_samples(httpx.post(target.url + route, json=body, timeout=30), samples(route, body))
    assert target.outcomes() == before  # refused before it was submitted
    target.assert_serving()


def test_the_largest_request_that_fits_is_served_in_full(target):
    r = httpx.post(target.url + "/v1/completions", timeout=60,
                   json={"prompt": ["a", "b"], "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in choices)
    target.assert_serving()


def test_a_request_larger_than_the_server_can_hold_is_400_through_the_router(target):
    router = RouterProcess("--worker-urls", target.url)
    try:
        for route, body in OVERSIZE:
            direct = httpx.post(target.url + route, json=body, timeout=30)
            through = router.client.post(route, json=body)
            assert_too_many_samples(through, samples(route, body))
            assert through.json() == direct.json()  # the server's verdict, passed through
        r = router.client.post("/generate", json=NORMAL)
        assert r.status_code == 200 and r.json()["text"] == target.reference, r.text
    finally:
        router.close()
    target.assert_serving()
