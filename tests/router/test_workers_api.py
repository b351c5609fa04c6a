"""Worker management at run time (POST / DELETE / GET /workers), draining workers, and
load shedding (503 + Retry-After) retried on other workers: fake workers behind an
in-process router."""

from __future__ import annotations

import contextlib
import threading
from urllib.parse import quote

import httpx
import pytest

from pdserve.router.fake_worker import FakeWorker, ThreadedServer
from pdserve.router.prefix_tree import PrefixTree
from tests.router.conftest import FakeDeployment, fake_deployment
from tests.server.conftest import assert_openai_error, parse_sse_lines
from tests.waiting import wait_until

COMPLETION = {"prompt": "hello", "max_tokens": 3}
FAST = ("--health-check-interval", "0.2", "--health-check-timeout", "0.5")


def legs(w: FakeWorker) -> list[dict]:
    return [b for _, b in w.requests]


def path_of(url: str) -> str:
    return "/workers/" + quote(url, safe="")


def listed(dep: FakeDeployment, **kw) -> dict[str, dict]:
    r = dep.client.get("/workers", **kw)
    assert r.status_code == 200, r.text
    return {w["url"]: w for w in r.json()["workers"]}


def new_worker(role: str, **faults) -> tuple[FakeWorker, ThreadedServer]:
    w = FakeWorker(role)
    for k, v in faults.items():
        setattr(w.faults, k, v)
    return w, ThreadedServer(w.app()).start()


# ---- POST /workers ----------------------------------------------------------------------
def test_an_added_worker_is_listed_and_gets_traffic():
    with fake_deployment(1, 1, *FAST) as dep:
        w, server = new_worker("decode")
        try:
            r = dep.client.post("/workers", json={"url": server.url, "role": "decode"})
            assert r.status_code == 201, r.text
            # Probed when added: a healthy worker is in rotation when the POST returns.
            assert r.json()["state"] == "healthy" and r.json()["in_rotation"] is True
            workers = listed(dep)
            assert len(workers) == 3
            me = workers[server.url]
            assert me["role"] == "decode" and me["source"] == "api" and me["in_flight"] == 0
            assert isinstance(me["since"], float) and isinstance(me["added_at"], float)
            for _ in range(4):
                assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
            assert len(w.requests) == 2 and len(dep.decode[0].requests) == 2  # in the round robin
        finally:
            server.stop()


def test_an_added_worker_not_healthy_yet_enters_rotation_at_a_later_probe():
    with fake_deployment(1, 1, *FAST) as dep:
        w, server = new_worker("decode", healthy=False)
        try:
            r = dep.client.post("/workers", json={"url": server.url, "role": "decode"})
            assert r.status_code == 201 and r.json()["state"] == "unhealthy", r.text
            for _ in range(2):
                assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
            assert not w.requests
            w.faults.healthy = True  # the health loop (every 0.2 s) finds it
            wait_until(lambda: dep.client.get(path_of(server.url)).json()["in_rotation"])
            for _ in range(2):
                assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
            assert len(w.requests) == 1
        finally:
            server.stop()


def test_a_prefill_worker_takes_its_bootstrap_port_as_the_flag_does():
    with fake_deployment(1, 1, *FAST) as dep:
        p1, s1 = new_worker("prefill")
        p2, s2 = new_worker("prefill")
        p3, s3 = new_worker("prefill")
        try:
            assert dep.client.post("/workers", json={"url": s1.url, "role": "prefill",
                                                     "bootstrap_port": 9100}).status_code == 201
            r = dep.client.post("/workers", json={"url": s2.url, "role": "prefill"})
            assert r.json()["bootstrap_port"] == 8998  # absent: the servers' default port
            r = dep.client.post("/workers", json={"url": s3.url, "role": "prefill", "bootstrap_port": None})
            assert r.json()["bootstrap_port"] is None  # null ('none'): let the servers pick
            old = dep.server_of(dep.prefill[0]).url
            assert dep.client.delete(path_of(old)).status_code == 202
            wait_until(lambda: dep.client.get(path_of(old)).status_code == 404)
            for _ in range(3):
                assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
            (b1,), (b2,), (b3,) = legs(p1), legs(p2), legs(p3)
            assert b1["bootstrap_port"] == 9100 and b2["bootstrap_port"] == 8998
            assert "bootstrap_port" not in b3 and b3["bootstrap_host"] == "127.0.0.1"
        finally:
            for s in (s1, s2, s3):
                s.stop()


def test_plain_router_takes_role_worker():
    with fake_deployment(0, 1, *FAST, plain=True) as dep:
        w, server = new_worker("plain")
        try:
            assert_openai_error(dep.client.post("/workers", json={"url": server.url, "role": "decode"}), 400,
                                ("role",))
            r = dep.client.post("/workers", json={"url": server.url, "role": "worker"})
            assert r.status_code == 201 and r.json()["role"] == "worker", r.text
            for _ in range(2):
                assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
            assert len(w.requests) == 1
        finally:
            server.stop()


@pytest.mark.parametrize("body, param", [
    ({"role": "decode"}, "url"),
    ({"url": 5, "role": "decode"}, "url"),
    ({"url": "127.0.0.1:1", "role": "decode"}, "url"),
    ({"url": "http://127.0.0.1:1/v1", "role": "decode"}, "url"),
    ({"url": "http://127.0.0.1:1"}, "role"),
    ({"url": "http://127.0.0.1:1", "role": "worker"}, "role"),   # a PD router
    ({"url": "http://127.0.0.1:1", "role": "decode", "bootstrap_port": 8998}, "bootstrap_port"),
    ({"url": "http://127.0.0.1:1", "role": "prefill", "bootstrap_port": 70000}, "bootstrap_port"),
    ({"url": "http://127.0.0.1:1", "role": "prefill", "bootstrap_port": "x"}, "bootstrap_port"),
    ({"url": "http://127.0.0.1:1", "role": "prefill", "bootstrap_port": True}, "bootstrap_port"),
    ({"url": "http://127.0.0.1:1", "role": "decode", "weight": 2}, "weight"),
])
def test_bad_bodies_are_400_naming_the_field(body, param):
    with fake_deployment(1, 1) as dep:
        err = assert_openai_error(dep.client.post("/workers", json=body), 400, (param,))
        assert err["message"].startswith(param)
        assert len(listed(dep)) == 2


def test_non_objects_duplicates_and_unknown_urls():
    with fake_deployment(1, 1) as dep:
        assert_openai_error(dep.client.post("/workers", content=b"[1]"), 400, ("body",))
        assert_openai_error(dep.client.post("/workers", content=b"{nope"), 400, ("body",))
        decode_url = dep.server_of(dep.decode[0]).url
        # Already registered (whatever the role): 409, nothing changed.
        err = assert_openai_error(dep.client.post("/workers", json={"url": decode_url, "role": "decode"}), 409,
                                  ("url",))
        assert "already registered" in err["message"]
        assert_openai_error(dep.client.post("/workers", json={"url": decode_url + "/", "role": "prefill"}), 409)
        assert_openai_error(dep.client.delete(path_of("http://127.0.0.1:1")), 404, ("url",))
        assert_openai_error(dep.client.get(path_of("http://127.0.0.1:1")), 404, ("url",))
        assert_openai_error(dep.client.delete(path_of("not-a-url")), 400, ("url",))
        assert len(listed(dep)) == 2


# ---- DELETE /workers/{url} --------------------------------------------------------------
def test_a_deleted_worker_gets_no_new_requests_and_its_in_flight_request_finishes():
    with fake_deployment(1, 2, *FAST) as dep:
        d0, d1 = dep.decode
        url0 = dep.server_of(d0).url
        d0.faults.gate = threading.Event()
        answer: dict = {}

        def slow_request() -> None:
            with httpx.Client(base_url=dep.url, timeout=30) as c:
                answer["r"] = c.post("/v1/completions", json=COMPLETION)
        t = threading.Thread(target=slow_request)
        t.start()
        wait_until(lambda: len(d0.requests) == 1)  # round robin: the first request went to d0
        wait_until(lambda: listed(dep)[url0]["in_flight"] == 1)
        r = dep.client.delete(path_of(url0))
        assert r.status_code == 202 and r.json()["state"] == "removing" and r.json()["in_flight"] == 1, r.text
        assert listed(dep)[url0]["in_rotation"] is False
        for _ in range(3):
            assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
        assert len(d0.requests) == 1 and len(d1.requests) == 3  # nothing new for the draining one
        assert dep.client.get(path_of(url0)).json()["state"] == "removing"  # still draining
        d0.faults.gate.set()
        t.join(30)
        assert answer["r"].status_code == 200 and answer["r"].json()["choices"][0]["text"] == "abc"
        rid = legs(d0)[0]["rid"]
        assert d0.finished == [rid] and rid not in d0.aborts  # finished, not aborted
        wait_until(lambda: dep.client.get(path_of(url0)).status_code == 404)
        assert url0 not in listed(dep)
        assert url0 not in dep.client.get("/metrics").text  # its series went with it
        # The URL can come back (a new server on the same address).
        assert dep.client.post("/workers", json={"url": url0, "role": "decode"}).status_code == 201


def test_removing_the_last_decode_worker_makes_the_router_unhealthy():
    with fake_deployment(1, 1) as dep:
        url = dep.server_of(dep.decode[0]).url
        assert dep.client.delete(path_of(url)).status_code == 202
        assert dep.client.get("/health").status_code == 503  # out of rotation at once
        err = assert_openai_error(dep.client.post("/v1/completions", json=COMPLETION), 503)
        assert "no healthy decode" in err["message"]


def test_cache_aware_forgets_a_removed_worker():
    tree = PrefixTree()
    tree.insert("abcdef", "a")
    tree.insert("abcxyz", "b")
    tree.insert("qrs", "b")
    size = tree.size
    tree.remove_worker("b")
    assert tree.match("abcxyz") == {"a": 3} and tree.match("qrs") == {}
    assert tree.size == size - len("xyz") - len("qrs")
    tree.remove_worker("a")
    assert tree.size == 0 and tree.match("abcdef") == {}
    with fake_deployment(2, 1, "--prefill-policy", "cache_aware") as dep:
        policy = dep.app.state.router.proxy.prefill_policy
        assert dep.client.post("/v1/completions", json={"prompt": "a long shared prefix " * 4}).status_code == 200
        served = next(w for w in dep.prefill if w.requests)
        url = dep.server_of(served).url
        assert url in policy.tree.match("a long shared prefix " * 4)
        assert dep.client.delete(path_of(url)).status_code == 202
        wait_until(lambda: dep.client.get(path_of(url)).status_code == 404)
        assert policy.tree.match("a long shared prefix " * 4) == {} and url not in policy._new_prefixes


# ---- keys -------------------------------------------------------------------------------
def test_worker_routes_need_the_api_key():
    with fake_deployment(1, 1, "--api-key", "k") as dep:
        assert_openai_error(dep.client.get("/workers"), 401)
        assert_openai_error(dep.client.post("/workers", json={"url": "http://127.0.0.1:1", "role": "decode"}), 401)
        assert_openai_error(dep.client.delete(path_of("http://127.0.0.1:1")), 401)
        assert len(listed(dep, headers={"Authorization": "Bearer k"})) == 2


def test_with_an_admin_key_worker_routes_need_it():
    with fake_deployment(1, 1, "--api-key", "k", "--admin-api-key", "adm") as dep:
        user, admin = {"Authorization": "Bearer k"}, {"Authorization": "Bearer adm"}
        assert_openai_error(dep.client.get("/workers", headers=user), 401)
        assert_openai_error(dep.client.get("/workers"), 401)
        url = dep.server_of(dep.decode[0]).url
        assert_openai_error(dep.client.delete(path_of(url), headers=user), 401)
        assert len(listed(dep, headers=admin)) == 2
        assert dep.client.delete(path_of(url), headers=admin).status_code == 202
        # The API key still opens the client routes.
        assert dep.client.get("/v1/models", headers=user).status_code in (200, 503)


# ---- a worker draining itself -----------------------------------------------------------
def test_a_draining_worker_leaves_rotation_without_counting_as_a_failure_and_comes_back():
    with fake_deployment(1, 2, *FAST) as dep:
        d0, d1 = dep.decode
        url0 = dep.server_of(d0).url
        d0.faults.draining = True  # /health: 503 {"status": "draining"}
        wait_until(lambda: listed(dep)[url0]["state"] == "draining")
        me = listed(dep)[url0]
        assert me["in_rotation"] is False and me["last_error"] is None
        assert dep.metric("pdserve_router:worker_draining", worker=url0) == 1
        before = len(d0.requests)
        for _ in range(3):
            assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
        assert len(d0.requests) == before and len(d1.requests) >= 3
        d0.faults.draining = False
        wait_until(lambda: listed(dep)[url0]["state"] == "healthy")
        # Never a failure: no failed probe, no error of any cause.
        assert dep.metric("pdserve_router:health_check_failures_total", worker=url0) == 0
        text = dep.client.get("/metrics").text
        errors = [line for line in text.splitlines() if line.startswith("pdserve_router:errors_total")]
        assert errors and all(line.endswith(" 0.0") for line in errors), errors
        # An unhealthy answer, by contrast, is a failed probe.
        d0.faults.healthy = False
        wait_until(lambda: listed(dep)[url0]["state"] == "unhealthy")
        assert dep.metric("pdserve_router:health_check_failures_total", worker=url0) >= 1


# ---- load shedding ----------------------------------------------------------------------
def test_a_shed_request_is_retried_on_another_decode_and_the_prefill_leg_aborted():
    def setup(w: FakeWorker) -> None:
        if w.role == "prefill":
            w.faults.delay_s = 0.5  # the prefill leg is live when decode sheds
    with fake_deployment(1, 2, "--retries", "0", configure=setup) as dep:
        d0, d1 = dep.decode
        d0.faults.shed_count = 1
        r = dep.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 200, r.text
        (shed,), (served,) = legs(d0), legs(d1)
        assert shed["rid"] != served["rid"] and shed["bootstrap_room"] != served["bootstrap_room"]
        # The first attempt's prefill leg (its room) is aborted, the retry's is not.
        wait_until(lambda: shed["rid"] in dep.prefill[0].aborts or
                   len([b for b in legs(dep.prefill[0]) if b["rid"] == shed["rid"]]) == 0)
        assert served["rid"] not in dep.prefill[0].aborts and served["rid"] in dep.prefill[0].finished
        assert dep.metric("pdserve_router:errors_total", cause="shed") == 1
        assert dep.metric("pdserve_router:retries_total") == 1
        # Shedding is not a failure of the worker: it stays in rotation.
        assert dep.worker_state()[dep.server_of(d0).url] is True


def test_a_shedding_prefill_is_retried_on_another_prefill():
    def setup(w: FakeWorker) -> None:
        if w.role == "decode":
            w.faults.delay_s = 0.5
    with fake_deployment(2, 1, configure=setup) as dep:
        p0, p1 = dep.prefill
        p0.faults.shed_count = 1
        r = dep.client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        assert len(p0.shed) == 1 and len(legs(p1)) == 1
        orphan = p0.shed[0]
        wait_until(lambda: orphan in dep.decode[0].aborts)  # decode's leg of the shed attempt: aborted
        assert legs(p1)[0]["rid"] in dep.decode[0].finished


def test_the_503_reaches_the_client_only_when_every_candidate_shed():
    with fake_deployment(1, 3, "--retries", "0") as dep:
        for w, after in zip(dep.decode, ("7", "3", "5")):
            w.faults.shed_count, w.faults.retry_after = 1, after
        r = dep.client.post("/v1/completions", json=COMPLETION)
        err = assert_openai_error(r, 503)
        assert "queue is full" in err["message"]
        assert r.headers["retry-after"] == "3"  # the soonest any of them named
        assert [len(w.requests) for w in dep.decode] == [1, 1, 1]  # each asked once, whatever --retries
        assert dep.metric("pdserve_router:errors_total", cause="shed") == 3
        # A stream is retried the same way before its first event.
        dep.decode[1].faults.shed_count = 1
        with dep.client.stream("POST", "/v1/completions", json=dict(COMPLETION, stream=True)) as s:
            assert s.status_code == 200
            events, done = parse_sse_lines(s.iter_lines())
        assert done and "".join(e["choices"][0]["text"] for e in events) == "abc"


def test_plain_mode_shed_retry_and_a_503_without_retry_after_is_a_plain_5xx():
    with fake_deployment(0, 2, "--retries", "0", plain=True) as dep:
        w0, w1 = dep.decode
        w0.faults.shed_count = 1
        assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
        assert len(w0.shed) == 1 and len(w1.requests) == 1
        # No Retry-After, not draining: a server error, under --retries (0 here).
        w1.faults.fail_status, w1.faults.fail_count = 503, 1
        w0.faults.fail_status, w0.faults.fail_count = 503, 1
        r = dep.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 503 and "retry-after" not in r.headers


def test_a_request_answered_draining_is_retried_and_the_worker_leaves_rotation():
    # Probes far apart: only the request's answer can tell the router.
    with fake_deployment(0, 2, "--health-check-interval", "30", "--retries", "0", plain=True) as dep:
        w0, w1 = dep.decode
        url0 = dep.server_of(w0).url
        w0.faults.draining = True  # its requests get 503 "draining" (its /health too)
        for _ in range(3):
            assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
        assert len(w0.requests) == 1 and len(w1.requests) == 3
        me = listed(dep)[url0]
        assert me["state"] == "draining" and me["last_error"] is None
        text = dep.client.get("/metrics").text
        errors = [line for line in text.splitlines() if line.startswith("pdserve_router:errors_total")]
        assert all(line.endswith(" 0.0") for line in errors), errors


def test_replacing_every_worker_under_load_loses_no_request():
    """A rolling update as the router sees it: 1P2D under a steady client load; each
    decode is replaced (new one added, old one deleted, stopped once removed), then the
    prefill. Every request succeeds, and a removed worker gets nothing more."""
    def slow(w: FakeWorker) -> None:
        w.faults.delay_s = 0.05  # requests are in flight when their worker is deleted
    with contextlib.ExitStack() as stack, fake_deployment(1, 2, *FAST, configure=slow) as dep:
        stop = threading.Event()
        statuses: list[int] = []

        def client_load() -> None:
            with httpx.Client(base_url=dep.url, timeout=30) as c:
                while not stop.is_set():
                    statuses.append(c.post("/v1/completions", json=COMPLETION).status_code)
        load = [threading.Thread(target=client_load) for _ in range(4)]
        for t in load:
            t.start()

        def replace(old: FakeWorker, role: str) -> FakeWorker:
            new, server = new_worker(role, delay_s=0.05)
            stack.callback(server.stop)
            before = len(statuses)
            assert dep.client.post("/workers", json={"url": server.url, "role": role}).status_code == 201
            old_url = dep.server_of(old).url
            assert dep.client.delete(path_of(old_url)).status_code == 202
            # Removed once its legs are done (each answered, so each recorded by the worker).
            wait_until(lambda: dep.client.get(path_of(old_url)).status_code == 404)
            seen = len(old.requests)
            wait_until(lambda: len(statuses) > before + 8)  # the load goes on meanwhile...
            assert len(old.requests) == seen  # ...and none of it reaches the removed worker
            dep.server_of(old).stop()  # the pod goes away
            return new
        try:
            for d in list(dep.decode):
                replace(d, "decode")
            replace(dep.prefill[0], "prefill")
        finally:
            stop.set()
            for t in load:
                t.join(30)
        assert statuses and set(statuses) == {200}, sorted(set(statuses))
        assert len(listed(dep)) == 3


def test_a_drained_worker_that_exits_is_no_failure_and_comes_back_when_restarted():
    with fake_deployment(1, 2, *FAST) as dep:
        d0 = dep.decode[0]
        server = dep.server_of(d0)
        d0.faults.draining = True
        wait_until(lambda: listed(dep)[server.url]["state"] == "draining")
        server.stop()  # its drain done, the server exits
        wait_until(lambda: "after draining" in (listed(dep)[server.url]["last_error"] or ""))
        assert listed(dep)[server.url]["state"] == "draining"
        assert dep.metric("pdserve_router:health_check_failures_total", worker=server.url) == 0
        d0.faults.draining = False
        back = ThreadedServer(d0.app(), port=server.port).start()  # restarted on its address
        try:
            wait_until(lambda: listed(dep)[server.url]["state"] == "healthy")
            for _ in range(2):
                assert dep.client.post("/v1/completions", json=COMPLETION).status_code == 200
            assert any(r == "/v1/completions" for r, _ in d0.requests)
        finally:
            back.stop()
