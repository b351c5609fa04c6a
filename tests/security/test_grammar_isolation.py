"""Issue 39, findings 1-4: grammar work must not stall other requests, replayed against
real server processes (the demo model).

- 1: a decode server whose constrained request's KV arrives before its grammar compiled
  (the schema warm on prefill, cold on decode) parks that request: a plain stream on the
  decode server keeps its pace (its longest gap, with and without the constrained
  request, as a ratio) and the constrained answer is valid. Same on a colocated server.
  A compile past --grammar-compile-timeout fails that request alone, naming the flag.
- 2: schemas nested past --grammar-max-depth or larger than --grammar-max-bytes are 400s
  naming the flag at once; legal but slow-to-parse schemas run on the grammar thread,
  so a plain request sent after them is answered first.
- 3: a client that leaves stops its compile (the compiling process is killed, nothing
  waits for it); the compiled-grammar cache stays within --grammar-cache-bytes and
  /flush_cache empties it.
- 4: the 7 MB schemas of the finding are refused by size; caches are keyed by digest
  (tests/scheduler/test_grammar_limits.py).

After every attack the server is healthy and answers a normal request as before.
Internals (limits, digests, deadlines, the HTTP deferral) are unit-tested in
tests/scheduler/test_grammar_limits.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

from pdserve.assets import path as asset_path
from pdserve.bench.grammar_isolation import Target, enum_schema, measure, warm_up
from tests.conftest import GREEDY
from tests.server.conftest import ServerProcess, free_port, start_servers
from tests.waiting import wait_until

NORMAL = {"text": "abc", "sampling_params": dict(GREEDY, max_new_tokens=6)}
# The longest gap of a plain stream while a cold enum compiles on its server may grow
# this much over its longest gap alone (the compile takes a core of a 2-core machine), or
# up to GAP_FLOOR_S (a 10 ms gap grown tenfold is still no stall); a stream that waited
# for the compile (the issue: 30.8 s; before the fix, here: 6-8 s) gaps for seconds.
MAX_GAP_RATIO = 8.0
GAP_FLOOR_S = 0.5
ENUM = 20000          # strings: 220 KB of schema, a compile of seconds in the compile process
HUGE_ENUM = 80000     # 880 KB: tens of seconds to compile (under --grammar-max-bytes)


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


class Served:
    """A server (or PD pair) and its answer to a normal request before any attack."""

    def __init__(self, target: Target, servers: list[ServerProcess]) -> None:
        self.target = target
        self.servers = servers
        self.main = servers[0]
        self.reference = self.normal()

    def normal(self) -> str:
        out = self.target.generate(NORMAL, timeout=60)
        assert out["status"] == 200, out
        return out["text"]

    def grammar(self) -> dict[str, Any]:
        return self.main.state()["grammar"]

    def post(self, path: str, body: Any, timeout: float = 120) -> httpx.Response:
        return httpx.post(self.main.url + path, json=body, timeout=timeout)

    def assert_serving(self) -> None:
        for s in self.servers:
            assert s.proc.poll() is None, s.output()[-4000:]
            assert httpx.get(s.url + "/health", timeout=10).status_code == 200
            assert "Exception in ASGI application" not in s.output()
        assert self.normal() == self.reference


@pytest.fixture(scope="module")
def colocated() -> Iterator[Served]:
    server = ServerProcess(asset_path("demo"), "--log-level", "warning")
    try:
        served = Served(Target(server.url), [server])
        warm_up(served.target)  # the vocabulary scan and the compile process start here
        wait_until(lambda: served.grammar()["worker_pid"], 120, step=0.2, what="the compile process started")
        yield served
    finally:
        server.close()


@pytest.fixture(scope="module")
def strict() -> Iterator[Served]:
    """A 2 s compile deadline, a 1 MiB compiled-grammar cache, nesting up to 8 levels."""
    server = ServerProcess(asset_path("demo"), "--log-level", "warning", "--grammar-compile-timeout", "2",
                           "--grammar-cache-bytes", str(1 << 20), "--grammar-max-depth", "8")
    try:
        yield Served(Target(server.url), [server])
    finally:
        server.close()


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[Served, int]]:
    boot = free_port()
    servers = start_servers(asset_path("demo"), {
        "decode": ("--disaggregation-mode", "decode"),
        "prefill": ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot))},
        "--log-level", "warning")
    try:
        yield Served(Target(servers["decode"].url, servers["prefill"].url, boot),
                     [servers["decode"], servers["prefill"]]), boot
    finally:
        for s in servers.values():
            with contextlib.suppress(Exception):
                s.close()


def assert_isolated(m: Any, schema: str) -> None:
    """The constrained answer is one of the enum's strings, and the plain stream kept its
    pace while it compiled."""
    assert m.constrained["status"] == 200 and m.constrained["meta_info"]["finish_reason"]["type"] == "stop", \
        m.constrained
    assert json.loads(m.constrained["text"]) in json.loads(schema)["enum"]
    longest = max(m.during)
    assert longest <= max(MAX_GAP_RATIO * max(m.base), GAP_FLOOR_S), m.lines("stall")
    # A stream that waited for the compile would gap for (nearly) the whole request.
    assert longest < 0.25 * m.constrained_s, m.lines("stall")


# ---- finding 1: the scheduler never waits for a compile ------------------------------------
def test_decode_streams_keep_pace_while_a_cold_grammar_compiles(pd):
    served, _ = pd
    schema = enum_schema(ENUM, seed=1)
    warm_up(served.target, prefill_schema=schema)  # warm on prefill, cold on decode
    parked: list[int] = []
    stop = threading.Event()

    def watch() -> None:  # the request's KV arrived before its grammar: it waited, parked
        while not stop.is_set():
            parked.append(served.main.state()["disaggregation"]["grammar_parked"])
            time.sleep(0.1)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        m = measure(served.target, schema)
    finally:
        stop.set()
        watcher.join(10)
    print("\n".join(m.lines("decode")))
    assert max(parked) == 1, "the constrained request never waited parked: the replay missed the race"
    assert_isolated(m, schema)
    assert served.main.state()["disaggregation"]["grammar_parked"] == 0
    served.assert_serving()


def test_colocated_stream_keeps_pace_while_a_cold_grammar_compiles(colocated):
    schema = enum_schema(ENUM, seed=2)
    m = measure(colocated.target, schema)
    print("\n".join(m.lines("colocated")))
    assert_isolated(m, schema)
    colocated.assert_serving()


def test_a_compile_past_its_deadline_fails_that_request_alone(strict):
    before = strict.grammar()["timed_out"]
    schema = json.loads(enum_schema(HUGE_ENUM, seed=3))
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(strict.post, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Pick one"}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}})
        wait_until(lambda: strict.grammar()["compiling"], 60, step=0.05, what="the compile started")
        plain = strict.post("/generate", dict(NORMAL, sampling_params=dict(GREEDY, max_new_tokens=40)))
        r = slow.result(timeout=120)
    assert plain.status_code == 200 and len(plain.json()["output_ids"]) == 40
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "--grammar-compile-timeout" in message and "2 s" in message, message
    # Nobody waits for the compile any more: it was stopped, not left running.
    wait_until(lambda: strict.grammar()["timed_out"] == before + 1 and strict.grammar()["compiling"] == 0, 60,
               step=0.05, what=lambda: f"the compile stopped ({strict.grammar()})")
    small = strict.post("/generate", {"text": "x", "sampling_params": {"regex": "(yes|no)", "max_new_tokens": 4}})
    assert small.status_code == 200 and small.json()["text"] in ("yes", "no"), small.text
    strict.assert_serving()


def test_the_servers_own_depth_limit_applies(strict):
    """--grammar-max-depth reaches the HTTP process's checks, not only the defaults."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "d", "schema": nested(6)}}}  # 13 levels
    r = strict.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("response_format.json_schema: ") and "--grammar-max-depth" in message, message
    body["response_format"]["json_schema"]["schema"] = nested(3)  # 7 levels: within the limit
    assert strict.post("/v1/chat/completions", body).status_code == 200
    strict.assert_serving()


# ---- finding 2: limits before parsing, parsing off the tokenizing threads -------------------
def test_deep_and_huge_schemas_are_400s_naming_the_limit_at_once(colocated):
    deep = json.dumps(nested(300))  # 601 levels: ~13 s of parse on xgrammar, were it parsed
    huge = json.dumps({"type": "object", "description": "x" * (7 << 20)})  # finding 4's padded 7 MB schema
    cases = [
        ("/generate", {"text": "x", "sampling_params": {"json_schema": deep}}, "json_schema", "--grammar-max-depth"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "d", "schema": nested(300)}}},
         "response_format.json_schema", "--grammar-max-depth"),
        ("/v1/completions", {"prompt": "x", "regex": "(" * 100 + "a" + ")" * 100}, "regex", "--grammar-max-depth"),
        ("/generate", {"text": "x", "sampling_params": {"json_schema": huge}}, "json_schema", "--grammar-max-bytes"),
    ]
    # The finding's replay: two deep schemas and a plain request at once; all answered at once.
    with ThreadPoolExecutor(len(cases) + 1) as pool:
        t0 = time.monotonic()
        answers = [pool.submit(colocated.post, path, body) for path, body, _, _ in cases]
        plain = pool.submit(colocated.post, "/generate", NORMAL)
        assert plain.result().status_code == 200 and plain.result().json()["text"] == colocated.reference
        for (path, _, field, flag), answer in zip(cases, answers):
            r = answer.result()
            assert r.status_code == 400, (path, r.text)
            message = r.json()["error"]["message"]
            assert message.startswith(f"{field}: ") and flag in message, (path, message)
        assert time.monotonic() - t0 < 10  # (a parse of the deep schema alone takes ~13 s)
    colocated.assert_serving()


def slow_schema(seed: int) -> str:
    """Within the limits (0.97 MB, 3 levels deep) but seconds to parse (each integer range
    becomes a regular expression), and invalid only at its end (a $ref to nothing), so
    its request ends at the parse with a 400."""
    props: dict[str, Any] = {f"p{i}": {"type": "integer", "minimum": -123456 - seed, "maximum": 987654}
                             for i in range(14000)}
    props["z"] = {"$ref": "#/$defs/missing"}
    return json.dumps({"type": "object", "properties": props})


def test_slow_schemas_parse_on_their_own_thread_not_the_tokenizing_ones(colocated):
    """Finding 2's replay: two schemas that take seconds each to parse, then a plain request.
    Parsed on the two tokenizing threads (before), the plain request waited for one of them."""
    bodies = [{"text": "x", "sampling_params": {"json_schema": slow_schema(seed), "max_new_tokens": 4}}
              for seed in (1, 2)]
    assert all(len(b["sampling_params"]["json_schema"]) < 1 << 20 for b in bodies)

    def timed(body: dict[str, Any]) -> tuple[httpx.Response, float]:
        r = colocated.post("/generate", body)
        return r, time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        slow = [pool.submit(timed, b) for b in bodies]
        time.sleep(0.5)  # (their bodies are in and their parses under way: each takes seconds)
        plain, plain_end = pool.submit(timed, NORMAL).result()
        slow_results = [f.result() for f in slow]
    assert plain.status_code == 200 and plain.json()["text"] == colocated.reference
    for r, _ in slow_results:
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("json_schema: invalid json schema"), \
            r.text
    # The plain request, sent after both, was answered before either parse ended.
    assert plain_end < min(end for _, end in slow_results)
    colocated.assert_serving()


# ---- finding 3: compiles nobody waits for stop; the cache is bounded and flushable ----------
def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_client_that_leaves_stops_its_compile(colocated):
    state = colocated.grammar()
    worker, cancelled = state["worker_pid"], state["cancelled"]
    assert worker and pid_running(worker)
    body = {"text": "Pick one:", "stream": True, "sampling_params": {
        "json_schema": enum_schema(HUGE_ENUM, seed=4), "max_new_tokens": 16}}
    with httpx.stream("POST", colocated.main.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        wait_until(lambda: colocated.grammar()["compiling"] == 1, 60, step=0.05, what="the compile started")
        time.sleep(1.0)  # well into a compile of tens of seconds
    # The client left: its compile is stopped (the process running it killed) at once.
    wait_until(lambda: colocated.grammar()["cancelled"] == cancelled + 1, 10, step=0.05,
               what=lambda: f"the compile cancelled ({colocated.grammar()})")
    assert colocated.grammar()["compiling"] == 0
    wait_until(lambda: not pid_running(worker), 5, step=0.05, what="the compiling process gone")
    # The next constrained request does not wait for it: a new process (started at once)
    # compiles it.
    wait_until(lambda: colocated.grammar()["worker_pid"] not in (None, worker), 120, step=0.1,
               what="a new compile process")
    schema = enum_schema(ENUM, seed=5)
    t0 = time.monotonic()
    out = colocated.target.generate({"text": "Pick one:", "sampling_params": {
        "json_schema": schema, "max_new_tokens": 16, "temperature": 0}})
    assert out["status"] == 200 and json.loads(out["text"]) in json.loads(schema)["enum"], out
    assert colocated.grammar()["worker_pid"] not in (None, worker)
    print(f"\nnext large constrained request after the client left: {time.monotonic() - t0:.1f} s")
    colocated.assert_serving()


def test_compiled_grammar_cache_stays_in_its_bound_and_flush_empties_it(strict):
    bound = 1 << 20
    # Enums of 1,500 strings (28 KB as EBNF: compiled on the scheduler's threads, ~150 KB
    # compiled each): together beyond the bound.
    for seed in range(8):
        out = strict.target.generate({"text": "Pick one:", "sampling_params": {
            "json_schema": enum_schema(1500, seed=100 + seed), "max_new_tokens": 12, "temperature": 0}})
        assert out["status"] == 200, out
        g = strict.grammar()
        assert g["cache_bytes"] <= bound == g["cache_limit_bytes"], g
    g = strict.grammar()
    assert 0 < g["cache_entries"] < g["compiled"], g  # some were evicted to stay within the bound
    r = strict.post("/flush_cache", None)
    assert r.status_code == 200 and "flushed" in r.text.lower()
    g = strict.grammar()
    assert g["cache_bytes"] == 0 and g["cache_entries"] == 0, g
    strict.assert_serving()
