"""A rolling update under load, with real servers on the demo model behind the real PD
router (issue 27's proof). 1 prefill + 2 decode servers serve a client load (threads
sending a fixed set of greedy requests in a loop: /v1/completions, streamed
/v1/completions and /generate) while, one at a time:

1. decode 1 is replaced in the README's order: the new decode server is added with
   POST /workers, the old one is taken out with DELETE /workers/{url} and then drained
   with SIGTERM;
2. decode 2 is replaced SIGTERM first, while it holds requests (the router learns of the
   drain from the server's /health or its draining 503s and asks another decode server),
   and is DELETEd from the router once it has exited;
3. a new prefill server (its own bootstrap port) is added and the old one DELETEd and
   drained.

Every client request succeeds on its first try (HTTP 200, a complete answer, no error
event), every answer equals the undisturbed one (computed through the router before the
update), each drained server exits 0, the surviving servers' pools are full, the router's
GET /workers lists exactly the new servers, and the router never failed a leg or a probe
(SIGTERM first included: a drained server waits for the next probe of a router still
watching it before it exits). Ordered on what is observed (completed requests, a server's
count in flight, the router's worker states), never on a sleep; no timing is asserted."""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator
from urllib.parse import quote

import httpx
import pytest

from pdserve.assets import path as asset_path
from tests.router.conftest import RouterProcess
from tests.server.conftest import ServerProcess, free_port, metric_value, parse_sse_lines, start_servers
from tests.waiting import wait_until

SERVER_FLAGS = ("--max-total-tokens", "8192", "--log-level", "warning", "--graceful-shutdown-timeout", "60")
MAX_TOKENS = 24
PROMPTS = ["Repeat: abc123xyz", "Repeat: hello world", "7+5=", "The quick brown fox", "Once upon a time",
           "Repeat: rolling update"]
KINDS = ("completion", "stream", "generate")
CONCURRENCY = 4
PER_STEP = 10          # requests completed (at least) after each step of the update
EXIT_TIMEOUT_S = 90.0  # a drained server's exit (drain, then uvicorn and the children stop)
# The router's error causes that mean a leg failed (draining and shedding 503s are not failures).
FAILURE_CAUSES = ("connect_error", "worker_5xx", "worker_4xx", "timeout", "stream_broken", "no_healthy_worker")


def worker_path(url: str) -> str:
    return "/workers/" + quote(url, safe="")


# ---- one request of the load, and what makes its answer complete ------------------------------
def send(client: httpx.Client, prompt: str, kind: str) -> str:
    """The answer's text; AssertionError if the request failed in any way."""
    if kind == "generate":
        r = client.post("/generate", json={"text": prompt, "sampling_params": {
            "max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, (r.status_code, r.text[:500])
        out = r.json()
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "length", meta
        assert meta["completion_tokens"] == MAX_TOKENS, meta
        return out["text"]
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if kind == "completion":
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, (r.status_code, r.text[:500])
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "length", out
        assert out["usage"]["completion_tokens"] == MAX_TOKENS, out
        return out["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json=dict(body, stream=True,
                                                            stream_options={"include_usage": True})) as s:
        assert s.status_code == 200, (s.status_code, s.read()[:500])
        events, done = parse_sse_lines(s.iter_lines())
    assert done, f"stream without [DONE]: {events[-3:]}"
    assert all("error" not in e for e in events), [e for e in events if "error" in e]
    finishes = [c["finish_reason"] for e in events for c in e.get("choices") or () if c.get("finish_reason")]
    assert finishes == ["length"], events[-3:]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == MAX_TOKENS, events[-3:]
    return "".join(c.get("text") or "" for e in events for c in e.get("choices") or ())


@dataclass
class Load:
    """CONCURRENCY threads sending (prompt, kind) requests in a loop through the router,
    each on its own connection, until stopped. Nothing is retried on the client side."""
    url: str
    results: list[tuple[str, str, str | None, str | None]] = field(default_factory=list)  # prompt, kind, text, err
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for i in range(CONCURRENCY):
            t = threading.Thread(target=self._run, args=(i,), name=f"load-{i}", daemon=True)
            t.start()
            self.threads.append(t)

    def _run(self, i: int) -> None:
        work = [(p, k) for p in PROMPTS for k in KINDS]
        n = i * 5  # the threads start at different points of the cycle
        with httpx.Client(base_url=self.url, timeout=120.0) as client:
            while not self.stop.is_set():
                prompt, kind = work[n % len(work)]
                n += 1
                try:
                    text, err = send(client, prompt, kind), None
                except Exception as exc:  # noqa: BLE001 - every failure is reported by the test
                    text, err = None, f"{type(exc).__name__}: {exc}"
                with self.lock:
                    self.results.append((prompt, kind, text, err))

    def done(self) -> int:
        with self.lock:
            return len(self.results)

    def errors(self) -> list[tuple[str, str, str | None, str | None]]:
        with self.lock:
            return [r for r in self.results if r[3] is not None]

    def advance(self, n: int = PER_STEP, what: str = "") -> None:
        """Wait until `n` more requests have completed (and fail fast on an error)."""
        target = self.done() + n

        def reached() -> bool:
            errors = self.errors()
            assert not errors, f"client errors ({what}): {errors[:3]}"
            return self.done() >= target
        wait_until(reached, 120.0, step=0.02, what=f"{n} more requests completed ({what})")

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180.0)
            assert not t.is_alive(), "a load thread is stuck"


# ---- the deployment --------------------------------------------------------------------
@pytest.fixture
def deployment(monkeypatch) -> Iterator[tuple[dict[str, ServerProcess], dict[str, int]]]:
    # Six servers on a few cores: one thread each, or their thread pools stall each other
    # (README, `pdserve up`).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    boots = {"p0": free_port(), "p1": free_port()}
    decode = ("--disaggregation-mode", "decode")
    # The old servers and their replacements (the new ones join the router later, through
    # POST /workers: a pod that is up but not yet in rotation).
    servers = start_servers(asset_path("demo"), {
        "p0": ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boots["p0"])),
        "p1": ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boots["p1"])),
        "d1": decode, "d2": decode, "d3": decode, "d4": decode,
    }, *SERVER_FLAGS)
    try:
        yield servers, boots
    finally:
        for s in servers.values():
            with contextlib.suppress(Exception):
                s.close()


def drained(server: ServerProcess, what: str) -> None:
    """The server exits 0 of its own after a drain, and no child of it survives."""
    try:
        code = server.proc.wait(EXIT_TIMEOUT_S)
    except Exception:
        raise AssertionError(f"{what} did not exit after its drain:\n{server.output()[-3000:]}") from None
    assert code == 0, f"{what} exited {code}:\n{server.output()[-3000:]}"
    graceful, alive = server.terminate()  # already gone: only checks the children
    assert graceful and not alive, (what, alive)


def test_rolling_update_under_load(deployment):
    servers, boots = deployment
    p0, p1, d1, d2, d3, d4 = (servers[k] for k in ("p0", "p1", "d1", "d2", "d3", "d4"))
    router = RouterProcess("--pd-disaggregation", "--prefill", p0.url, str(boots["p0"]),
                           "--decode", d1.url, "--decode", d2.url, "--health-check-interval", "0.5")
    load = Load(router.url)
    try:
        admin = router.client

        def workers() -> dict[str, dict[str, Any]]:
            r = admin.get("/workers", timeout=10)
            assert r.status_code == 200, r.text
            return {w["url"]: w for w in r.json()["workers"]}

        def add(server: ServerProcess, role: str, **extra: Any) -> None:
            r = admin.post("/workers", json={"url": server.url, "role": role, **extra}, timeout=30)
            assert r.status_code == 201, r.text
            assert r.json()["in_rotation"] is True, r.json()  # healthy: probed when added
            # It takes its share of the load.
            before = server.finished()
            load.advance(what=f"after adding {role} {server.url}")
            wait_until(lambda: server.finished() > before, 60.0, what=f"{role} {server.url} serving requests")

        def failures() -> dict[str, float]:
            return {c: router.metric("pdserve_router:errors_total", cause=c) for c in FAILURE_CAUSES}

        def delete(server: ServerProcess) -> None:
            r = admin.delete(worker_path(server.url), timeout=30)
            assert r.status_code == 202, r.text
            assert r.json()["in_rotation"] is False, r.json()

        def gone_from_router(server: ServerProcess) -> None:
            wait_until(lambda: admin.get(worker_path(server.url), timeout=10).status_code == 404, 60.0,
                       what=lambda: f"{server.url} removed from the router: {workers().get(server.url)}")

        def replace_delete_first(old: ServerProcess, new: ServerProcess, role: str, name: str,
                                 **extra: Any) -> None:
            """The README's order: add the new one, DELETE the old one from the router,
            then drain it (SIGTERM) while the router's removal waits for its legs."""
            add(new, role, **extra)
            delete(old)
            old.proc.send_signal(signal.SIGTERM)
            gone_from_router(old)
            drained(old, f"{name} (DELETE, then SIGTERM)")
            load.advance(what=f"{name} replaced")

        # The undisturbed answers, before the update.
        with httpx.Client(base_url=router.url, timeout=120.0) as c:
            expected = {(p, k): send(c, p, k) for p in PROMPTS for k in KINDS}
        assert all(expected.values()), expected

        load.start()
        load.advance(what="before the update")

        # 1. decode 1, the README's order.
        replace_delete_first(d1, d3, "decode", "decode 1")

        # Up to here (the README's order) the router never failed a leg nor a probe.
        assert failures() == {c: 0.0 for c in FAILURE_CAUSES}, router.output()[-3000:]
        assert router.metric("pdserve_router:health_check_failures_total") == 0, router.output()[-3000:]

        # 2. decode 2, SIGTERM first, while it holds requests: the router learns of the
        #    drain from its /health or its draining 503s and keeps it out of rotation; the
        #    clients see nothing of it. It is DELETEd once it has exited.
        add(d4, "decode")
        wait_until(lambda: d2.info()["in_flight_requests"] > 0, 60.0, step=0.005,
                   what="decode 2 holding a request")
        d2.proc.send_signal(signal.SIGTERM)
        drained(d2, "decode 2 (SIGTERM first)")
        load.advance(what="decode 2 drained")
        # The router saw the drain (the server waits for its next probe before it goes,
        # pdserve/server/drain.py): no failure, no leg sent to a server already gone.
        w2 = workers()[d2.url]
        assert w2["state"] == "draining", (w2, router.output()[-3000:])
        assert router.metric("pdserve_router:health_check_failures_total", worker=d2.url) == 0, w2
        assert failures() == {c: 0.0 for c in FAILURE_CAUSES}, router.output()[-3000:]
        delete(d2)
        gone_from_router(d2)

        # 3. prefill, the README's order (the new one with its own bootstrap port).
        replace_delete_first(p0, p1, "prefill", "prefill 0", bootstrap_port=boots["p1"])
        # Never a failed leg or probe, in either order.
        assert failures() == {c: 0.0 for c in FAILURE_CAUSES}, router.output()[-3000:]

        # The router has exactly the new servers, all in rotation.
        final = workers()
        assert set(final) == {p1.url, d3.url, d4.url}, final
        assert {u: (w["role"], w["state"], w["in_rotation"]) for u, w in final.items()} == {
            p1.url: ("prefill", "healthy", True), d3.url: ("decode", "healthy", True),
            d4.url: ("decode", "healthy", True)}, final
        assert final[p1.url]["bootstrap_port"] == boots["p1"], final
    finally:
        load.finish()
        metrics = ""
        with contextlib.suppress(httpx.HTTPError):
            metrics = router.client.get("/metrics", timeout=10).text
        router.close()

    # Every request succeeded at once and answered what the undisturbed deployment answered.
    results = load.results
    errors = [r for r in results if r[3] is not None]
    assert not errors, errors[:5]
    wrong = [(p, k, t, expected[(p, k)]) for p, k, t, _ in results if t != expected[(p, k)]]
    assert not wrong, wrong[:5]
    assert len(results) >= 6 * PER_STEP

    # The survivors are idle with every KV page and request slot free.
    for s in (p1, d3, d4):
        s.assert_pools_full()
    print(f"rolling update: {len(results)} requests under load, all equal to the undisturbed answers; "
          f"router retries (draining 503s asked elsewhere) {metric_value(metrics, 'pdserve_router:retries_total'):g}")



def test_sigterm_first_on_an_idle_worker_is_no_failure():
    """SIGTERM first, with nothing in flight: the drain is over at once, but the server
    waits for the next /health probe of the router watching it, so the router takes it out
    of rotation as draining (no health-check failure, no warning) rather than finding it
    gone. (Before: "unhealthy", a failed probe and a warning.)"""
    (server,) = start_servers(asset_path("demo"), {"s": ("--disaggregation-mode", "null")}, *SERVER_FLAGS).values()
    try:
        router = RouterProcess("--worker-urls", server.url, "--health-check-interval", "1")
        try:
            url = worker_path(server.url)
            wait_until(lambda: router.client.get(url).json()["in_rotation"], 30.0, what="worker in rotation")
            server.proc.send_signal(signal.SIGTERM)
            drained(server, "the idle server (SIGTERM)")
            w = router.client.get(url).json()
            assert w["state"] == "draining" and w["in_rotation"] is False, w
            assert router.metric("pdserve_router:health_check_failures_total", worker=server.url) == 0, w
            assert "out of rotation" not in router.output(), router.output()[-2000:]
        finally:
            router.close()
    finally:
        server.close()
