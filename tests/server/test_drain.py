"""Graceful drain and load shedding on a real server (pdserve/server/drain.py).

- SIGTERM with a request in flight: /health answers 503 `"status": "draining"` while the
  request still runs, new requests get 503, the request finishes normally (all its
  tokens, `[DONE]`), the process exits 0 and leaves no child.
- `--graceful-shutdown-timeout 0`: what is in flight is aborted with an error naming the
  flag (a 503 body, or an error event then `[DONE]` on a stream), and the process exits 0.
- POST /drain (admin key) does what SIGTERM does.
- `--max-queued-requests` with `--max-running-requests 1`: once the queue holds its limit,
  new requests get 503 + Retry-After at once; every accepted request finishes.

Every wait is on something observed (a stream event, /get_server_info's count of requests
in flight, the process's exit), never on a sleep.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import signal
import threading
from typing import Any

import httpx
import pytest

from tests.conftest import GREEDY
from tests.server.conftest import ServerProcess, assert_openai_error, parse_sse_lines, pid_alive
from tests.waiting import wait_until

# Long enough (seconds of decoding on the tiny model) that the checks made right after
# the drain began happen while it still runs; within the model's 1024 positions.
LONG_TOKENS = 1000
# What the drain's deadline must find unfinished: far more than the tiny model decodes
# between the test's checks and SIGTERM on a loaded machine (1000 tokens took ~1 s, and a
# stream the scheduler has finished is delivered in full, not aborted).
UNFINISHABLE_TOKENS = 7000
EXIT_TIMEOUT_S = 120.0


def long_stream_body(tokens: int = LONG_TOKENS) -> dict[str, Any]:
    # Top logprobs make its events heavy (each repeats the whole result so far): what is
    # left to deliver once its client pauses is more than the connection's buffers hold,
    # so it stays in flight until the client reads on, however fast decoding is.
    return {"text": "drain me", "stream": True, "return_logprob": True, "top_logprobs_num": 5,
            "sampling_params": dict(GREEDY, max_new_tokens=tokens)}


def data_events(lines: Any, n: int) -> list[str]:
    """The first `n` `data:` lines of a stream (the rest stays unread)."""
    got = []
    for line in lines:
        if line.startswith("data:"):
            got.append(line)
            if len(got) == n:
                break
    return got


def assert_draining_health(server: ServerProcess) -> dict[str, Any]:
    """/health is 503 with "status": "draining" (polled: SIGTERM reaches the event loop
    asynchronously); returns its body."""
    def draining() -> dict[str, Any] | None:
        r = httpx.get(server.url + "/health", timeout=5.0)
        return r.json() if r.status_code == 503 else None
    body = wait_until(draining, 10.0, what="/health 503 once draining")
    assert body["status"] == "draining", body
    return body


def assert_refused(r: httpx.Response, what: str) -> None:
    err = assert_openai_error(r, 503)
    assert what in err["message"], err
    assert int(r.headers["retry-after"]) >= 1, r.headers
    # A drain's refusal says "draining" as /health does (a router takes the server out of
    # rotation); a full queue's does not (the router tries another worker).
    assert (r.json().get("status") == "draining") == (what == "draining"), r.json()


def wait_exit(server: ServerProcess, children: set[int]) -> None:
    """The server exits 0 by itself and no child survives it."""
    code = server.proc.wait(EXIT_TIMEOUT_S)
    assert code == 0, f"exit code {code}:\n{server.output()[-3000:]}"
    wait_until(lambda: not any(pid_alive(p) for p in children), 15.0, step=0.1,
               what=lambda: f"children gone (alive: {[p for p in children if pid_alive(p)]})")


def finish_stream(lines: Any, first: list[str]) -> tuple[list[Any], bool]:
    events, done = parse_sse_lines(first + list(lines))
    assert not any("error" in e for e in events), [e for e in events if "error" in e]
    return events, done


@pytest.mark.parametrize("how", ["sigterm", "post_drain"])
def test_drain_finishes_the_request_in_flight(start_server, llama_dir, how):
    admin = "drain-admin-key"
    s = start_server(llama_dir, "--graceful-shutdown-timeout", "300", "--admin-api-key", admin)
    try:
        children = s.remember_pids()
        assert s.client.get("/health").status_code == 200
        info = s.info()
        assert info["draining"] is False and info["graceful_shutdown_timeout"] == 300, info
        with httpx.stream("POST", s.url + "/generate", json=long_stream_body(), timeout=EXIT_TIMEOUT_S) as r:
            assert r.status_code == 200, r.read()[:300]
            lines = r.iter_lines()
            first = data_events(lines, 3)  # running, with many tokens to go
            if how == "sigterm":
                s.proc.send_signal(signal.SIGTERM)
            else:
                # The admin route: the API key holder alone may not drain the server.
                assert_openai_error(httpx.post(s.url + "/drain", timeout=5.0), 401)
                d = httpx.post(s.url + "/drain", headers={"Authorization": f"Bearer {admin}"}, timeout=5.0)
                assert d.status_code == 200, d.text
                assert d.json()["status"] == "draining" and d.json()["started"] is True, d.json()
            health = assert_draining_health(s)
            # Observed while the request still ran (it has not been read to its end).
            assert health["in_flight_requests"] == 1 and health["drain_cause"] == (
                "SIGTERM" if how == "sigterm" else "POST /drain"), health
            info = s.info()
            assert info["draining"] is True and info["in_flight_requests"] == 1, info
            # New generation requests are refused, on every route.
            assert_refused(s.client.post("/generate", json={"text": "new", "sampling_params": GREEDY}),
                           "draining")
            assert_refused(s.client.post("/v1/completions", json={"prompt": "new", "max_tokens": 2}),
                           "draining")
            # A second signal changes nothing (Kubernetes sends SIGTERM after a preStop drain).
            s.proc.send_signal(signal.SIGTERM)
            events, done = finish_stream(lines, first)
        assert done, events[-2:]
        final = events[-1]
        assert final["meta_info"]["finish_reason"]["type"] == "length", final["meta_info"]
        assert final["meta_info"]["completion_tokens"] == LONG_TOKENS, final["meta_info"]
        wait_exit(s, children)
    finally:
        s.close()


def test_drain_deadline_aborts_what_is_left(start_server, model_dirs):
    # 0 s: the drain aborts at once whatever is in flight (a positive deadline would make
    # the outcome depend on how fast this machine decodes).
    s = start_server(model_dirs("llama_long_context"), "--graceful-shutdown-timeout", "0",
                     "--max-total-tokens", "16384")
    try:
        children = s.remember_pids()
        result: dict[str, httpx.Response] = {}

        def blocking() -> None:
            result["r"] = httpx.post(s.url + "/v1/completions", timeout=EXIT_TIMEOUT_S,
                                     json={"prompt": "cut me", "max_tokens": UNFINISHABLE_TOKENS, "temperature": 0,
                                           "ignore_eos": True})
        t = threading.Thread(target=blocking, daemon=True)
        with httpx.stream("POST", s.url + "/generate", json=long_stream_body(UNFINISHABLE_TOKENS),
                          timeout=EXIT_TIMEOUT_S) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = data_events(lines, 2)
            t.start()
            wait_until(lambda: s.info()["in_flight_requests"] == 2, 30.0, what="both requests in flight")
            s.proc.send_signal(signal.SIGTERM)
            events, done = parse_sse_lines(first + list(lines))
        # The stream: the tokens so far, then one error event, then [DONE].
        assert done
        errors = [e for e in events if "error" in e]
        assert len(errors) == 1 and events[-1] is errors[0], events[-3:]
        assert "--graceful-shutdown-timeout" in errors[0]["error"]["message"], errors
        assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1]), events[-2:]
        t.join(EXIT_TIMEOUT_S)
        err = assert_openai_error(result["r"], 503)
        assert "--graceful-shutdown-timeout" in err["message"] and "aborted" in err["message"], err
        wait_exit(s, children)
        assert "aborted 2 request(s)" in s.output(), s.output()[-2000:]
    finally:
        s.close()


def test_queue_limit_sheds_load(start_server, model_dirs):
    # The long request decodes for several seconds (8k positions), so the two behind it
    # are surely still queued through the burst; it is aborted once the burst is checked.
    s = start_server(model_dirs("llama_long_context"), "--max-running-requests", "1",
                     "--max-queued-requests", "2", "--max-total-tokens", "8192")
    try:
        budgets = [7000, 16, 16]
        with concurrent.futures.ThreadPoolExecutor(16) as pool, httpx.Client(timeout=EXIT_TIMEOUT_S) as client:
            # 1 running + 2 waiting: the queue is at its limit.
            def submit(n: int, **extra: Any) -> concurrent.futures.Future:
                return pool.submit(client.post, s.url + "/generate",
                                   json={"text": "queued", "sampling_params": dict(GREEDY, max_new_tokens=n), **extra})
            held = [submit(budgets[0], rid="long")]
            wait_until(lambda: s.state()["num_running_reqs"] == 1, 30.0, what="the long request running")
            held += [submit(n) for n in budgets[1:]]
            wait_until(lambda: s.info()["in_flight_requests"] == 3, 30.0, what="3 requests in flight")
            st = s.state()
            assert st["num_running_reqs"] == 1, st
            # A burst now: every request is refused at once, none is queued.
            burst = [pool.submit(httpx.post, s.url + path, json=b, timeout=30.0) for path, b in (
                [("/generate", {"text": f"burst {i}", "sampling_params": dict(GREEDY, max_new_tokens=4)})
                 for i in range(6)]
                + [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                             "stream": True})] * 2)]
            for f in burst:
                assert_refused(f.result(), "--max-queued-requests 2")
            assert s.info()["in_flight_requests"] == 3
            # Every accepted request ends: the long one aborted with its partial result,
            # the queued ones in full.
            assert client.post(s.url + "/abort_request", json={"rid": "long"}).json()["aborted"] is True
            long_answer = held[0].result().json()["meta_info"]
            assert long_answer["finish_reason"]["type"] == "abort" and long_answer["completion_tokens"] < budgets[0]
            for f, n in zip(held[1:], budgets[1:]):
                r = f.result()
                assert r.status_code == 200, r.text[:300]
                assert r.json()["meta_info"]["completion_tokens"] == n
            # A mixed burst against an idle server: each answer is a full result or a 503
            # with Retry-After, never anything else; the first three always fit.
            mixed = [pool.submit(httpx.post, s.url + "/generate", timeout=60.0,
                                 json={"text": f"mixed {i}", "sampling_params": dict(GREEDY, max_new_tokens=64)})
                     for i in range(12)]
            answers = [f.result() for f in mixed]
        ok = [r for r in answers if r.status_code == 200]
        for r in answers:
            if r.status_code == 200:
                assert r.json()["meta_info"]["completion_tokens"] == 64
            else:
                assert_refused(r, "--max-queued-requests")
        assert len(ok) >= 3, [r.status_code for r in answers]
        s.assert_pools_full()
    finally:
        s.close()


def test_flags_are_validated():
    from pdserve.config import ConfigError, ServerArgs

    assert ServerArgs().graceful_shutdown_timeout == 30.0 and ServerArgs().max_queued_requests is None
    args = ServerArgs.from_cli(["--graceful-shutdown-timeout", "0", "--max-queued-requests", "0"])
    assert args.graceful_shutdown_timeout == 0 and args.max_queued_requests == 0
    for argv, name in ((["--graceful-shutdown-timeout", "-1"], "--graceful-shutdown-timeout"),
                       (["--max-queued-requests", "-2"], "--max-queued-requests")):
        with pytest.raises(ConfigError, match=name):
            ServerArgs.from_cli(argv)


def test_queue_limit_counts_samples_beyond_the_running_slots():
    from pdserve.server.drain import QueueLimit, Refused, TooManySamples

    limit = QueueLimit(max_queued=2, max_running=4)
    limit.check(in_flight=5, new=1)      # 2 would wait: at the limit, accepted
    with pytest.raises(Refused) as exc:
        limit.check(in_flight=6, new=1)  # 3 would wait
    assert exc.value.retry_after >= 1 and "--max-queued-requests 2" in exc.value.message
    with pytest.raises(Refused):
        limit.check(in_flight=3, new=4)  # n=4 samples: 3 would wait
    limit.check(in_flight=0, new=6)      # an idle server takes any request that can fit
    with pytest.raises(TooManySamples, match=r"^n: .*50 samples.*4 running \(--max-running-requests\) "
                       r"\+ 2 queued \(--max-queued-requests\) = 6"):
        limit.check(in_flight=0, new=50)  # never: a 400, not a 503 to retry
    QueueLimit(max_queued=None, max_running=1).check(in_flight=10_000, new=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        limit.max_queued = 3  # type: ignore[misc]


def test_a_drain_over_waits_for_the_next_probe_of_a_connected_router(monkeypatch):
    """Nothing in flight: the drain is over at once, but a client that was probing /health
    on a connection still open (a router) gets until its next probe to see the drain; a
    client whose connection closed (a router that removed the server first, a kubelet) is
    not waited for; nor anyone past LINGER_MAX_S."""
    from pdserve.server import drain as drain_mod

    class Idle:
        def in_flight_requests(self) -> int:
            return 0

        async def abort_all(self, reason: str) -> int:
            return 0

    router, kubelet = ("10.0.0.7", 40001), ("10.0.0.9", 51234)  # the kubelet: a connection per probe

    async def scenario(open_peers: set, probe_again: bool) -> bool:
        """Whether the drain stopped the server before the router's next probe."""
        d = drain_mod.Drain(Idle(), timeout=30.0)
        stopped = asyncio.Event()
        d.stop = stopped.set
        d.open_peers = lambda: open_peers
        d.probed(router)
        d.probed(kubelet)
        d.start("SIGTERM")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stopped.wait(), 1.0)
        early = stopped.is_set()
        if probe_again:
            d.probed(router)
            await asyncio.wait_for(stopped.wait(), 5.0)
            assert d.watchers() == set()
        return early

    assert asyncio.run(scenario({router}, probe_again=True)) is False  # waited for the probe
    assert asyncio.run(scenario(set(), probe_again=False)) is True    # connection closed: at once
    monkeypatch.setattr(drain_mod, "LINGER_MAX_S", 0.2)
    assert asyncio.run(scenario({router}, probe_again=False)) is True  # bounded
