"""A decode server SIGKILLed under load, on NIXL, behind the real PD router (the chaos
test of tests/router/test_pd_e2e.py::test_decode_deaths, on the other transfer engine and
with requests in flight).

One prefill server and two decode servers on the demo model, every one with
``--disaggregation-transfer-backend nixl`` (BACKEND), behind the real router. A few client
threads send greedy /v1/completions (ignore_eos, half of them streamed): one thread a
prompt long enough that its KV goes over in dozens of chunked writes, the others short
ones (no prefix cache anywhere). Once decode 2 holds the long request while
the prefill server is still early in computing and sending its KV (seen in the servers'
/get_server_info, never waited for with a sleep), decode 2 and its children are
SIGKILLed. Then:

- every request the load sent got exactly one final outcome within a bounded time: a
  complete 200 answer equal to the undisturbed one (computed through the router before
  the kill), or a clean error (an HTTP error status with an OpenAI error body, or for a
  stream an OpenAI error event then [DONE], after a prefix of the undisturbed text);
  never a hang, a broken connection or a truncated answer passed off as complete;
- the router takes decode 2 out of rotation within seconds, and every request sent after
  that succeeds, through decode 1;
- the prefill server failed the room that was in flight to decode 2 (its
  internal_state's disaggregation failures; which reason depends on what reached it
  first, see `test_decode_killed_under_load`), and it and decode 1 end idle with full
  pools.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx
import pytest

from pdserve.assets import path as asset_path
from tests.router.conftest import RouterProcess
from tests.server.conftest import ServerProcess, assert_openai_error, free_port, parse_sse_lines, start_servers
from tests.waiting import wait_until

# The transfer engine of every server. "mooncake" runs the same test on the default engine
# (a check that nothing below is NIXL-specific by accident).
BACKEND = "nixl"
# No prefix cache: every request's whole prompt is computed again by the prefill server
# and its whole KV crosses the transfer engine (a cached long prompt would be sent in one
# step, or not at all to a decode server that has it: no room to catch in flight).
SERVER_FLAGS = ("--max-total-tokens", "16384", "--log-level", "warning", "--disable-radix-cache",
                "--disaggregation-transfer-backend", BACKEND)
# Small prefill chunks: the long prompt's KV goes over in dozens of writes, one per
# prefill step, so its room stays in flight long enough (about a second) to be caught.
PREFILL_CHUNK = "32"
MAX_TOKENS = 24
LONG_PROMPT = "Repeat: " + " ".join(f"w{i}" for i in range(300))  # ~1400 tokens (one per character)
# Each under one KV page with its answer (PD pages hold 64 tokens).
SHORT_PROMPTS = ["Repeat: abc123xyz", "7+5=", "The quick brown fox", "Once upon a time"]
PROMPTS = [LONG_PROMPT, *SHORT_PROMPTS]
KINDS = ("completion", "stream")
CONCURRENCY = 4  # thread 0 sends the long prompt (one at a time), the others the short ones
CLIENT_TIMEOUT_S = 30.0  # a request not over by then has hung (the long one takes about 2 s)
AFTER_OUT_OF_ROTATION = 8  # requests the load completes once decode 2 is out of rotation
PROBES = 4                 # then short requests sent one at a time: each is decode 1's
# The prefill server's room failure reasons that a dead decode server can cause (see the test).
DEAD_PEER_REASONS = ("peer_dead", "transfer_error", "aborted")


# ---- one request and its outcome ----------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    prompt: str
    kind: str
    started: float
    ended: float
    ok: bool            # a complete answer (else a clean error)
    text: str           # the answer, or for an error stream what came before the error
    detail: str = ""    # the error's message
    bad: str = ""       # not an acceptable final outcome: why (the test fails on it)


def send(client: httpx.Client, prompt: str, kind: str) -> tuple[bool, str, str]:
    """(complete, text, error message) of one request; AssertionError when its outcome is
    neither a complete answer nor a clean error."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if kind == "completion":
        r = client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return False, "", assert_openai_error(r, r.status_code)["message"]
        out = r.json()
        choice = out["choices"][0]
        assert choice["finish_reason"] == "length", out
        assert out["usage"]["completion_tokens"] == MAX_TOKENS, out
        return True, choice["text"], ""
    with client.stream("POST", "/v1/completions",
                       json=dict(body, stream=True, stream_options={"include_usage": True})) as s:
        if s.status_code != 200:
            s.read()
            return False, "", assert_openai_error(s, s.status_code)["message"]
        events, done = parse_sse_lines(s.iter_lines())
    assert done, f"stream without [DONE]: {events[-3:]}"
    errors = [i for i, e in enumerate(events) if "error" in e]
    text = "".join(c.get("text") or "" for e in events for c in e.get("choices") or ())
    if errors:
        # One error event, the last one: the stream's one outcome is that error.
        assert errors == [len(events) - 1], events[-3:]
        err = events[-1]["error"]
        assert err.get("type") == "server_error" and isinstance(err.get("message"), str) and err["message"], err
        return False, text, err["message"]
    finishes = [c["finish_reason"] for e in events for c in e.get("choices") or () if c.get("finish_reason")]
    assert finishes == ["length"], events[-3:]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == MAX_TOKENS, events[-3:]
    return True, text, ""


@dataclass
class Load:
    """CONCURRENCY threads sending (prompt, kind) requests in a loop through the router,
    each on its own connection, until stopped; one Outcome per request. Nothing is
    retried on the client side."""
    url: str
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for i in range(CONCURRENCY):
            t = threading.Thread(target=self._run, args=(i,), name=f"load-{i}", daemon=True)
            t.start()
            self.threads.append(t)

    def _run(self, i: int) -> None:
        work = [(p, k) for p in ([LONG_PROMPT] if i == 0 else SHORT_PROMPTS) for k in KINDS]
        n = i * 3  # the threads start at different points of the cycle
        with httpx.Client(base_url=self.url, timeout=CLIENT_TIMEOUT_S) as client:
            while not self.stop.is_set():
                prompt, kind = work[n % len(work)]
                n += 1
                t0 = time.monotonic()
                ok, text, detail, bad = False, "", "", ""
                try:
                    ok, text, detail = send(client, prompt, kind)
                except Exception as exc:  # noqa: BLE001 - every such outcome fails the test
                    bad = f"{type(exc).__name__}: {exc}"
                with self.lock:
                    self.outcomes.append(Outcome(prompt, kind, t0, time.monotonic(), ok, text, detail, bad))

    def done(self) -> int:
        with self.lock:
            return len(self.outcomes)

    def wait_for(self, n: int, what: str) -> None:
        """Until `n` requests in all have ended."""
        wait_until(lambda: self.done() >= n, 60.0, step=0.02, what=f"{n} requests ended ({what})")

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(CLIENT_TIMEOUT_S + 10)
            assert not t.is_alive(), "a load thread is stuck"


# ---- the deployment -----------------------------------------------------------------------
@pytest.fixture
def deployment(monkeypatch) -> Iterator[tuple[dict[str, ServerProcess], RouterProcess]]:
    # Four processes with thread pools on a few cores: one thread each (README, `pdserve up`).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    boot = free_port()
    decode = ("--disaggregation-mode", "decode")
    servers = start_servers(asset_path("demo"), {
        "prefill": ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
                    "--chunked-prefill-size", PREFILL_CHUNK),
        "decode1": decode, "decode2": decode,
    }, *SERVER_FLAGS)
    router = None
    try:
        router = RouterProcess("--pd-disaggregation", "--prefill", servers["prefill"].url, str(boot),
                               "--decode", servers["decode1"].url, "--decode", servers["decode2"].url)
        yield servers, router
    finally:
        if router is not None:
            router.close()
        for s in servers.values():
            with contextlib.suppress(Exception):
                s.close()


def disagg(server: ServerProcess) -> dict[str, Any]:
    return server.state()["disaggregation"]


def used_pages(state: dict[str, Any]) -> int:
    """KV pages held by requests (not free, not merely cached)."""
    mem = state["memory"]
    return mem["kv_pages_total"] - mem["kv_pages_free"] - mem["kv_pages_evictable"]


def test_decode_killed_under_load(deployment):
    servers, router = deployment
    prefill, d1, d2 = servers["prefill"], servers["decode1"], servers["decode2"]
    t_start = time.monotonic()
    assert {s.info()["server_args"]["disaggregation_transfer_backend"] for s in servers.values()} == {BACKEND}

    # The undisturbed answers, through the router before the kill (greedy, ignore_eos: the
    # same tokens whichever decode server answers, streamed or not).
    with httpx.Client(base_url=router.url, timeout=CLIENT_TIMEOUT_S) as c:
        expected = {p: send(c, p, "completion")[1] for p in PROMPTS}
        long_tokens = c.post("/tokenize", json={"prompt": LONG_PROMPT}).json()["count"]
    assert all(expected.values()), expected
    assert disagg(prefill)["failures"] == {}, disagg(prefill)
    page_size = prefill.info()["server_args"]["page_size"]
    long_pages = -(-long_tokens // page_size)
    # The most the short requests hold: a page each on the prefill server (prompt), two on
    # a decode server (prompt and answer, and a page reserved ahead). The long one's pages
    # stand out.
    short_prefill_pages, short_decode_pages = CONCURRENCY - 1, 2 * (CONCURRENCY - 1)
    assert long_pages // 2 > max(short_prefill_pages, short_decode_pages), (long_pages, page_size)

    def long_room_early_in_flight_to_decode2() -> bool:
        """The prefill server is computing (and sending) the long prompt and has at most
        half of it done: its room has half its chunked writes to go (hundreds of ms). Then
        (read after) decode 2 holds pages reserved for a prompt that long: the same
        request (the one long one in flight: the next is sent once this one has been
        answered), so its room is decode 2's."""
        held = used_pages(prefill.state())
        if not short_prefill_pages < held <= long_pages // 2:
            return False
        st = d2.state()
        return st["disaggregation"]["transferring"] > 0 and used_pages(st) > long_pages // 2

    load = Load(router.url)
    try:
        load.start()
        load.wait_for(CONCURRENCY, "before the kill")
        wait_until(long_room_early_in_flight_to_decode2, 60.0, step=0.005,
                   what=lambda: f"the long prompt's room early in flight to decode 2 (prefill: "
                                f"{prefill.state()['memory']}, decode 2: {d2.state()['memory']})")
        killed = time.monotonic()
        d2.kill_all()

        # The router takes decode 2 out of rotation (the failed legs, or its health probe).
        wait_until(lambda: router.worker_health().get(d2.url) is False, 10.0, step=0.02,
                   what="decode 2 out of the router's rotation")
        out_of_rotation = time.monotonic()
        load.wait_for(load.done() + AFTER_OUT_OF_ROTATION, "after decode 2 left the rotation")
    finally:
        load.finish()
    elapsed_kill = out_of_rotation - killed
    assert elapsed_kill < 3.0, f"decode 2 left the rotation {elapsed_kill:.1f} s after the kill"

    # Every request: exactly one final outcome (one record per request by construction, its
    # shape checked in send()), in bounded time, acceptable.
    outcomes = load.outcomes
    bad = [o for o in outcomes if o.bad]
    assert not bad, [(o.prompt[:20], o.kind, o.bad) for o in bad[:5]]
    slow = [o for o in outcomes if o.ended - o.started > CLIENT_TIMEOUT_S]
    assert not slow, slow[:3]
    wrong = [(o.prompt[:20], o.kind, o.text, expected[o.prompt]) for o in outcomes
             if o.ok and o.text != expected[o.prompt]]
    assert not wrong, wrong[:3]
    # An error ends what came of the undisturbed answer (no wrong token before it); only
    # requests under way at the kill may end so.
    errors = [o for o in outcomes if not o.ok]
    assert all(expected[o.prompt].startswith(o.text) for o in errors), [(o.kind, o.text, o.detail) for o in errors]
    assert all(o.started < out_of_rotation for o in errors), [(o.started - killed, o.detail) for o in errors]
    # The kill hit requests in flight: at least decode 2's waiting request was sent again
    # (nothing of it had reached its client).
    assert router.metric("pdserve_router:retries_total") >= 1, router.output()[-3000:]
    # Every request sent once decode 2 was out of rotation succeeded.
    after = [o for o in outcomes if o.started >= out_of_rotation]
    assert len(after) >= AFTER_OUT_OF_ROTATION - CONCURRENCY and all(o.ok for o in after), after[:3]

    # New requests go to decode 1, and all succeed.
    assert router.worker_health() == {prefill.url: True, d1.url: True, d2.url: False}
    d1.wait_idle()
    before = d1.finished()
    with httpx.Client(base_url=router.url, timeout=CLIENT_TIMEOUT_S) as c:
        for i in range(PROBES):
            prompt = SHORT_PROMPTS[i % len(SHORT_PROMPTS)]
            ok, text, detail = send(c, prompt, KINDS[i % len(KINDS)])
            assert ok and text == expected[prompt], (ok, text, detail)
    assert d1.finished() - before == PROBES

    # The prefill server failed the long prompt's room (in flight to decode 2 at the kill,
    # with hundreds of ms of writes to go), and maybe others of decode 2's. The reason it
    # records is whatever reached it first: its next KV write to the dead peer failed
    # (transfer_error), decode 2's heartbeats stopped (peer_dead, after 3 missed
    # intervals), or the router, whose decode leg broke at once, aborted the prefill leg
    # (/abort_request: aborted). Behind the router the abort usually wins, so peer_dead or
    # transfer_error alone is not guaranteed. No room failed for another reason (a deadline).
    failures = disagg(prefill)["failures"]
    assert set(failures) <= set(DEAD_PEER_REASONS), failures
    assert sum(failures.values()) >= 1, failures
    prefill.assert_pools_full()
    d1.assert_pools_full()
    rooms = disagg(prefill)["rooms"]
    assert rooms["bootstrapping"] + rooms["waiting_for_input"] + rooms["transferring"] == 0, rooms
    print(f"decode killed under load on {BACKEND}: {len(outcomes)} requests "
          f"({sum(o.ok for o in outcomes)} complete, {len(errors)} clean errors), out of rotation after "
          f"{elapsed_kill:.2f} s, router retries {router.metric('pdserve_router:retries_total'):g}, "
          f"prefill room failures {failures}; test body {time.monotonic() - t_start:.1f} s")
