"""The router's request handling against fake workers (in-process, fast): what each leg
receives, retries and orphan aborts, error passthrough, streams that break, clients
that go away, health-based rotation."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pdserve.router.fake_worker import FakeWorker, ThreadedServer
from tests.router.conftest import fake_deployment
from tests.server.conftest import assert_openai_error, parse_sse_lines
from tests.waiting import wait_until

COMPLETION = {"prompt": "hello", "max_tokens": 3}


def legs(w: FakeWorker, route: str | None = None) -> list[dict]:
    return [b for r, b in w.requests if route is None or r == route]


# ---- what the legs get ----------------------------------------------------------------
def test_both_legs_get_the_same_body_rid_and_room():
    with fake_deployment(1, 1) as dep:
        r = dep.client.post("/v1/completions", json=dict(COMPLETION, temperature=0))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "abc"
        (p,), (d,) = legs(dep.prefill[0]), legs(dep.decode[0])
        assert p == d
        assert p["bootstrap_host"] == "127.0.0.1" and p["bootstrap_port"] == 9000
        assert isinstance(p["bootstrap_room"], int) and 0 <= p["bootstrap_room"] < 2**63
        assert isinstance(p["rid"], str) and p["temperature"] == 0 and p["prompt"] == "hello"


@pytest.mark.parametrize("route, body, rooms", [
    ("/v1/completions", {"prompt": "x", "n": 3}, 3),
    ("/v1/completions", {"prompt": ["x", "y"], "n": 2}, 4),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 2),
    ("/generate", {"text": ["x", "y", "z"], "sampling_params": {"n": 2}}, 6),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": {"max_new_tokens": 2}}, 2),
])
def test_one_room_per_sample(route, body, rooms):
    with fake_deployment(1, 1) as dep:
        r = dep.client.post(route, json=body)
        assert r.status_code == 200, r.text
        sent = legs(dep.decode[0])[0]
        assert sent == legs(dep.prefill[0])[0]
        assert isinstance(sent["bootstrap_room"], list) and len(sent["bootstrap_room"]) == rooms
        assert len(set(sent["bootstrap_room"])) == rooms
        assert isinstance(sent["bootstrap_host"], str) and isinstance(sent["bootstrap_port"], int)
        if route == "/generate":  # one rid per prompt there
            assert isinstance(sent["rid"], list) and len(sent["rid"]) == len(body.get("text") or body["input_ids"])


def test_rooms_are_fresh_per_request_and_round_robin_spreads():
    with fake_deployment(2, 2) as dep:
        for _ in range(4):
            assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
        assert [len(w.requests) for w in dep.prefill + dep.decode] == [2, 2, 2, 2]
        rooms = [b["bootstrap_room"] for w in dep.decode for b in legs(w)]
        assert len(set(rooms)) == 4
        ports = sorted(b["bootstrap_port"] for w in dep.prefill for b in legs(w))
        assert ports == [9000, 9000, 9001, 9001]
        assert dep.metric("pdserve_router:worker_requests_total", role="decode") == 4


def test_plain_mode_forwards_without_bootstrap_fields():
    with fake_deployment(0, 2, plain=True) as dep:
        for _ in range(2):
            assert dep.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
                                   ).status_code == 200
        bodies = [b for w in dep.decode for b in legs(w)]
        assert len(bodies) == 2 and all("bootstrap_room" not in b for b in bodies)
        assert [len(w.requests) for w in dep.decode] == [1, 1]
        assert dep.client.get("/health").status_code == 200
        assert dep.client.get("/v1/models").json()["data"][0]["id"] == "fake-plain"


# ---- the router's own refusals ------------------------------------------------------
def test_router_refuses_non_objects_and_router_fields():
    with fake_deployment(1, 1) as dep:
        assert_openai_error(dep.client.post("/v1/completions", content=b"[1, 2]"), 400, ("body",))
        assert_openai_error(dep.client.post("/v1/completions", content=b"{nope"), 400, ("body",))
        assert_openai_error(dep.client.post("/generate", json={"text": "x", "bootstrap_room": 5}), 400,
                            ("bootstrap_room",))
        assert_openai_error(dep.client.get("/nope"), 404)
        assert not dep.decode[0].requests and not dep.prefill[0].requests


def test_worker_4xx_passes_through_and_the_other_leg_is_aborted():
    def slow_prefill(w: FakeWorker) -> None:
        if w.role == "prefill":
            w.faults.delay_s = 0.5
    with fake_deployment(1, 1, configure=slow_prefill) as dep:
        r = dep.client.post("/v1/completions", json=dict(COMPLETION, unknown_field=1))
        err = assert_openai_error(r, 400, ("unknown_field",))
        assert err["message"] == "unknown_field: unsupported field"  # the worker's own body
        assert dep.metric("pdserve_router:requests_total", outcome="client_error") == 1
        # Only decode refuses: the prefill leg, still running, is aborted.
        seen = len(legs(dep.prefill[0]))
        dep.decode[0].faults.fail_status, dep.decode[0].faults.fail_count = 400, 1
        err = assert_openai_error(dep.client.post("/v1/completions", json=COMPLETION), 400)
        assert err["message"] == "injected failure on the decode worker"
        # On a loaded machine the router may cancel the prefill POST before the worker
        # has read it (nothing runs there then); a leg the worker did get is aborted.
        try:
            wait_until(lambda: len(legs(dep.prefill[0])) > seen, timeout=3.0)
        except AssertionError:
            assert len(legs(dep.prefill[0])) == seen
        else:
            rid = legs(dep.prefill[0])[-1]["rid"]
            wait_until(lambda: rid in dep.prefill[0].aborts)
        assert dep.metric("pdserve_router:retries_total") == 0


# ---- retries before the first token -------------------------------------------------
def test_prefill_5xx_is_retried_on_another_pair_and_the_orphan_decode_leg_aborted():
    def setup(w: FakeWorker) -> None:
        if w.role == "decode":
            w.faults.delay_s = 0.3  # the decode leg is live when the prefill leg fails
    with fake_deployment(2, 1, configure=setup) as dep:
        bad = dep.prefill[0]
        bad.faults.fail_status, bad.faults.fail_count = 500, 1
        r = dep.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 200, r.text
        first, second = legs(dep.decode[0])
        assert first["rid"] != second["rid"] and first["bootstrap_room"] != second["bootstrap_room"]
        retry = legs(dep.prefill[1])  # the retry went to the other prefill
        assert len(retry) == 1
        # Under load the cancelled first leg can reach the worker after the retry's leg:
        # tell them apart by rid (both legs of an attempt share it), not by arrival order.
        orphan = ({first["rid"], second["rid"]} - {retry[0]["rid"]}).pop()
        wait_until(lambda: orphan in dep.decode[0].aborts)
        assert second["rid"] not in dep.decode[0].aborts
        assert dep.decode[0].finished == [second["rid"]]
        assert dep.metric("pdserve_router:retries_total") == 1
        assert dep.metric("pdserve_router:errors_total", cause="worker_5xx") == 1
        # The worker answered: a 5xx does not take it out of rotation.
        assert dep.worker_state()[dep.server_of(bad).url] is True


def test_retries_exhausted_return_the_workers_error():
    with fake_deployment(1, 1) as dep:
        dep.decode[0].faults.fail_status, dep.decode[0].faults.fail_count = 503, 2
        err = assert_openai_error(dep.client.post("/v1/completions", json=COMPLETION), 503)
        assert "injected failure" in err["message"]
        assert len(dep.decode[0].requests) == 2  # the first try and one retry
    with fake_deployment(1, 1, "--retries", "0") as dep:
        dep.decode[0].faults.fail_status, dep.decode[0].faults.fail_count = 503, 1
        assert_openai_error(dep.client.post("/v1/completions", json=COMPLETION), 503)
        assert len(dep.decode[0].requests) == 1


def test_server_side_abort_is_retried():
    """A /generate leg that ends with an abort (e.g. a failed KV transfer) before anything
    reached the client is a failure like a 5xx."""
    with fake_deployment(1, 1) as dep:
        dep.decode[0].faults.abort_next = 1
        r = dep.client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length", r.text
        assert dep.metric("pdserve_router:retries_total") == 1
        dep.decode[0].faults.abort_next = 1
        with dep.client.stream("POST", "/generate", json={"text": "x", "stream": True}) as s:
            events, done = parse_sse_lines(s.iter_lines())
        assert done and events[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert dep.metric("pdserve_router:retries_total") == 2


def test_connection_failure_takes_the_worker_out_at_once():
    # Probes far apart: only the failed request can notice the dead worker.
    with fake_deployment(2, 1, "--health-check-interval", "30") as dep:
        dead = dep.server_of(dep.prefill[0])
        dead.stop()
        # A real decode answers only after prefill's transfer, so never before a dead
        # prefill's refused connection; the instant fake could (seen on a loaded machine:
        # the late prefill failure is then only logged and nothing is retried).
        dep.decode[0].faults.delay_s = 0.5
        # Whichever prefill each request is sent to, every request succeeds.
        for _ in range(4):
            assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
        assert dep.worker_state()[dead.url] is False
        assert dep.metric("pdserve_router:errors_total", cause="connect_error") == 1
        assert dep.metric("pdserve_router:retries_total") == 1
        assert len(legs(dep.prefill[1])) == 4


def test_a_dead_worker_comes_back_after_a_successful_probe():
    with fake_deployment(2, 1, "--health-check-interval", "0.2") as dep:
        dead = dep.server_of(dep.prefill[0])
        dead.stop()
        # No request goes to it: only the probes can take it out, and put it back.
        wait_until(lambda: dep.worker_state()[dead.url] is False)
        back = ThreadedServer(dep.prefill[0].app(), port=dead.port).start()
        try:
            wait_until(lambda: dep.worker_state()[dead.url])
            for _ in range(2):
                assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
            assert len(legs(dep.prefill[0])) == 1  # back in the round robin
        finally:
            back.stop()


# ---- health ---------------------------------------------------------------------------
def test_unhealthy_workers_leave_rotation_and_503_when_none_left():
    with fake_deployment(1, 2, "--health-check-interval", "0.2", "--health-check-timeout", "0.2") as dep:
        assert dep.client.get("/health").status_code == 200
        assert dep.client.get("/readiness").status_code == 200 and dep.client.get("/liveness").status_code == 200
        d0, d1 = dep.decode
        d0.faults.healthy = False
        url0 = dep.server_of(d0).url
        wait_until(lambda: not dep.worker_state()[url0])
        before = len(d0.requests)
        for _ in range(3):
            assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
        assert len(d0.requests) == before  # out of rotation: only d1 gets requests
        d1.faults.healthy = False
        wait_until(lambda: dep.client.get("/health").status_code == 503)
        # Not ready, but alive: a liveness probe must not restart it (Kubernetes' livenessProbe).
        assert dep.client.get("/readiness").status_code == 503 and dep.client.get("/liveness").status_code == 200
        n_before = len(dep.prefill[0].requests)
        t0 = time.monotonic()
        err = assert_openai_error(dep.client.post("/v1/completions", json=COMPLETION), 503)
        # At once: not held until a worker comes back or the request times out (1800 s).
        assert time.monotonic() - t0 < 5.0 and "decode" in err["message"]
        assert len(dep.prefill[0].requests) == n_before  # never half a request
        assert dep.metric("pdserve_router:errors_total", cause="no_healthy_worker") >= 1
        d0.faults.healthy = True
        wait_until(lambda: dep.client.get("/health").status_code == 200)
        assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_a_hung_worker_leaves_rotation_within_interval_plus_timeout():
    with fake_deployment(1, 2) as dep:  # the defaults: probes every 1 s, 1 s timeout
        hung = dep.decode[0]
        url = dep.server_of(hung).url
        hung.faults.health_delay_s = 30
        # Out after interval + timeout (2 s); a probe without its timeout would hang 30 s.
        wait_until(lambda: not dep.worker_state()[url], timeout=10)
        assert "failed" in dep.client.get("/get_server_info").json()["decode"][0]["last_error"]
        hung.faults.health_delay_s = 0
        wait_until(lambda: dep.worker_state()[url])


def test_server_info_aggregates_workers():
    with fake_deployment(1, 2) as dep:
        info = dep.client.get("/get_server_info").json()
        assert [w["role"] for w in info["prefill"]] == ["prefill"]
        assert len(info["decode"]) == 2 and info["decode"][0]["avg_spec_accept_length"] == 2.5
        assert info["avg_spec_accept_length"] == 2.5 and info["router"]["mode"] == "pd"
        assert info["prefill"][0]["bootstrap_port"] == 9000 and info["decode"][0]["healthy"] is True


# ---- streams --------------------------------------------------------------------------
def test_stream_passes_events_through():
    with fake_deployment(1, 1) as dep:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
        with dep.client.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            events, done = parse_sse_lines(s.iter_lines())
        assert done and "".join(e["choices"][0]["delta"]["content"] for e in events) == "abc"
        assert dep.metric("pdserve_router:time_to_first_token_seconds_count") == 1
        assert dep.metric("pdserve_router:inter_token_latency_seconds_count") == 2


def test_stream_error_before_first_event_is_an_http_error():
    with fake_deployment(1, 1, "--retries", "0") as dep:
        dep.decode[0].faults.fail_status, dep.decode[0].faults.fail_count = 400, 1
        r = dep.client.post("/v1/completions", json=dict(COMPLETION, stream=True))
        assert_openai_error(r, 400)


def test_decode_dying_mid_stream_ends_with_an_error_event_and_done():
    with fake_deployment(1, 1) as dep:
        dep.decode[0].tokens = 10
        dep.decode[0].faults.drop_after_events = 3
        with dep.client.stream("POST", "/v1/completions", json=dict(COMPLETION, max_tokens=10, stream=True)) as s:
            assert s.status_code == 200
            events, done = parse_sse_lines(s.iter_lines())
        assert done
        assert [e["choices"][0]["text"] for e in events[:3]] == ["a", "b", "c"]
        assert len(events) == 4 and events[-1]["error"]["type"] == "server_error"
        assert "mid-stream" in events[-1]["error"]["message"]
        assert len(dep.decode[0].requests) == 1  # nothing is retried once tokens went out
        assert dep.metric("pdserve_router:errors_total", cause="stream_broken") == 1


def test_client_disconnect_aborts_the_legs():
    with fake_deployment(1, 1) as dep:
        d = dep.decode[0]
        d.tokens, d.faults.event_delay_s = 100, 0.05
        with httpx.stream("POST", dep.url + "/generate", json={"text": "x", "stream": True,
                                                               "sampling_params": {"max_new_tokens": 100}}) as s:
            for line in s.iter_lines():
                if line.startswith("data:"):
                    break
        rid = legs(d)[0]["rid"]
        wait_until(lambda: rid in d.aborts and not d.live)
        assert dep.metric("pdserve_router:errors_total", cause="client_disconnect") == 1
        # Non-streaming: a client that times out and goes away aborts both legs too.
        d.faults.hold = True
        dep.prefill[0].faults.hold = True
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(dep.url + "/v1/completions", json=COMPLETION, timeout=0.5)
        rid = legs(d)[-1]["rid"]
        wait_until(lambda: rid in d.aborts and rid in dep.prefill[0].aborts)
        wait_until(lambda: not d.live and not dep.prefill[0].live)
        assert dep.metric("pdserve_router:errors_total", cause="client_disconnect") == 2


def test_abort_by_client_rid_through_the_router():
    with fake_deployment(1, 1) as dep:
        d = dep.decode[0]
        d.faults.hold = True
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(r=httpx.post(
            dep.url + "/generate", json={"text": "x", "rid": "my-req"}, timeout=10)))
        t.start()
        wait_until(lambda: "my-req" in d.live)
        r = dep.client.post("/abort_request", json={"rid": "my-req"})
        assert r.json() == {"rid": "my-req", "aborted": True}
        t.join(10)
        # The client's own abort is not retried: it gets the aborted result.
        assert box["r"].status_code == 200
        assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(d.requests) == 1
        assert dep.client.post("/abort_request", json={"rid": "my-req"}).json()["aborted"] is False


def test_api_key():
    with fake_deployment(1, 1, "--api-key", "sekret") as dep:
        for probe in ("/health", "/readiness", "/liveness"):  # probes carry no key
            assert dep.client.get(probe).status_code == 200, probe
        assert_openai_error(dep.client.post("/v1/completions", json=COMPLETION), 401)
        r = dep.client.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200


def test_metrics_exposition():
    with fake_deployment(1, 1) as dep:
        dep.client.post("/v1/completions", json=COMPLETION)
        text = dep.client.get("/metrics").text
        for name in ("pdserve_router:e2e_request_latency_seconds_bucket", "pdserve_router:requests_total",
                     "pdserve_router:worker_requests_total", "pdserve_router:errors_total",
                     "pdserve_router:worker_healthy", "pdserve_router:time_to_first_token_seconds"):
            assert name in text, name
        assert dep.metric("pdserve_router:requests_total", route="/v1/completions", outcome="success") == 1


def test_cache_aware_prefill_routing_through_the_router():
    with fake_deployment(2, 2, "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two") as dep:
        system = "You are a helpful assistant. " * 8
        for q in ("first question", "second question", "third question"):
            body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
            assert dep.client.post("/v1/chat/completions", json=body).status_code == 200
        counts = sorted(len(w.requests) for w in dep.prefill)
        assert counts == [0, 3]  # one prefix, one prefill server
        assert dep.client.post("/v1/completions", json={"prompt": "unrelated text entirely"}).status_code == 200
        assert sorted(len(w.requests) for w in dep.prefill) == [1, 3]  # a new prefix: the idle one
