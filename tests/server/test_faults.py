"""Faults and load: a client disconnecting mid-stream aborts its request and frees its KV,
a burst of 300 concurrent requests all come back right, a dead scheduler gives errors
(not hangs) and /health 503, and SIGTERM leaves no process behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import threading
import time

import httpx

from tests.conftest import GREEDY, random_prompts
from tests.server.conftest import parse_sse_lines, pid_alive, read_data_events, scheduler_pid
from tests.waiting import wait_until


def long_stream_requests(model: str, tokens: int = 960):
    """(path, body) of streaming requests that would run for many seconds."""
    return [
        ("/v1/completions", {"model": model, "prompt": "disconnect me", "max_tokens": tokens,
                             "temperature": 0, "ignore_eos": True, "stream": True}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "bye"}],
                                  "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                                  "stream": True}),
        ("/generate", {"text": "disconnect me too", "stream": True,
                       "sampling_params": dict(GREEDY, max_new_tokens=tokens)}),
    ]


# ---- disconnect ------------------------------------------------------------------------
def test_disconnect_aborts_and_frees_kv(start_server, model_dirs):
    # 7000-token requests on the 8k model: all three surely still run when checked (the
    # tiny model decodes 960 tokens in about a second).
    model_dir = model_dirs("llama_long_context")
    server = start_server(model_dir, "--max-total-tokens", "32768")
    server.assert_pools_full()
    aborts = server.finished("abort")
    with contextlib.ExitStack() as stack:
        streams = []
        for path, body in long_stream_requests(str(model_dir), tokens=7000):
            r = stack.enter_context(httpx.stream("POST", server.url + path, json=body,
                                                 headers=server.headers, timeout=30.0))
            assert r.status_code == 200, (path, r.status_code, r.read()[:500])
            streams.append(r.iter_lines())
        # Read a few events from each so every request is running.
        for lines in streams:
            assert read_data_events(lines, 3) == 3
        st = server.state()
        assert st["num_running_reqs"] + st["num_waiting_reqs"] == 3, st
    # The connections are closed: the requests (960 tokens each) must stop now, as aborts
    # (not run out to their length).
    wait_until(lambda: server.finished("abort") == aborts + 3, 10.0,
               what=lambda: f"3 aborts after the disconnects (state: {server.state()})")
    server.assert_pools_full()
    server.close()


# ---- burst -----------------------------------------------------------------------------------
N_BURST = 300


def burst_plan():
    rng = random.Random(42)
    short = random_prompts(N_BURST - 20, 3, 40, seed=101)
    long = random_prompts(20, 200, 400, seed=102)
    prompts = short + long
    rng.shuffle(prompts)
    kinds = ["completions", "completions_stream", "generate", "generate_stream"]
    plan = []
    for i, ids in enumerate(prompts):
        kind = kinds[i % 4]
        plan.append({"i": i, "ids": ids, "max_tokens": rng.randint(4, 16), "kind": kind})
    return plan


async def stream_events(client: httpx.AsyncClient, path: str, body: dict, i: int) -> list:
    """The events of a streamed request, which must end with [DONE]."""
    async with client.stream("POST", path, json=dict(body, stream=True)) as r:
        assert r.status_code == 200, (i, r.status_code)
        lines = [line async for line in r.aiter_lines()]
    events, done = parse_sse_lines(lines)
    assert done, i
    return events


async def run_one(client: httpx.AsyncClient, model: str, item: dict) -> dict:
    kind, ids, n = item["kind"], item["ids"], item["max_tokens"]
    if kind.startswith("completions"):
        body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        if kind == "completions":
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, (item["i"], r.status_code, r.text[:300])
            d = r.json()
            return {"id": d["id"], "text": d["choices"][0]["text"],
                    "completion_tokens": d["usage"]["completion_tokens"]}
        events = await stream_events(client, "/v1/completions", body, item["i"])
        assert len({e["id"] for e in events}) == 1
        return {"id": events[0]["id"], "text": "".join(e["choices"][0]["text"] for e in events
                                                       if e.get("choices"))}
    body = {"input_ids": ids, "sampling_params": dict(GREEDY, max_new_tokens=n)}
    if kind == "generate":
        r = await client.post("/generate", json=body)
        assert r.status_code == 200, (item["i"], r.status_code, r.text[:300])
        d = r.json()
        return {"id": d["meta_info"]["id"], "text": d["text"], "output_ids": d["output_ids"],
                "completion_tokens": d["meta_info"]["completion_tokens"]}
    last = (await stream_events(client, "/generate", body, item["i"]))[-1]
    return {"id": last["meta_info"]["id"], "text": last["text"],
            "completion_tokens": last["meta_info"]["completion_tokens"]}


async def run_burst(server, model: str, plan: list[dict]) -> list:
    limits = httpx.Limits(max_connections=N_BURST + 10, max_keepalive_connections=N_BURST + 10)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, limits=limits,
                                 timeout=httpx.Timeout(120.0, connect=30.0)) as client:
        tasks = [run_one(client, model, item) for item in plan]
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 180.0)


def test_burst_of_concurrent_requests(server, engine, llama_dir):
    plan = burst_plan()
    refs = engine.generate(input_ids=[p["ids"] for p in plan],
                           sampling_params=[dict(GREEDY, max_new_tokens=p["max_tokens"]) for p in plan])
    t0 = time.monotonic()
    results = asyncio.run(run_burst(server, str(llama_dir), plan))
    elapsed = time.monotonic() - t0
    errors = [(p["i"], p["kind"], repr(r)[:300]) for p, r in zip(plan, results)
              if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {N_BURST} requests failed, e.g. {errors[:5]}"
    wrong = []
    for p, r, ref in zip(plan, results, refs):
        if r["text"] != ref["text"] or ("output_ids" in r and r["output_ids"] != ref["output_ids"]) \
                or r.get("completion_tokens", p["max_tokens"]) != p["max_tokens"]:
            wrong.append((p["i"], p["kind"], len(p["ids"]), r, ref["text"]))
    assert not wrong, f"{len(wrong)} of {N_BURST} outputs differ from the reference, e.g. {wrong[:3]}"
    ids = [r["id"] for r in results]
    assert len(set(ids)) == N_BURST, "duplicated request ids"
    print(f"burst of {N_BURST}: {elapsed:.1f}s")
    server.assert_pools_full(timeout=30.0)


# ---- scheduler death -------------------------------------------------------------------------
def test_scheduler_killed_gives_errors_not_hangs(start_server, model_dirs):
    # 7000-token requests on the 8k-context model: both are surely still running when the
    # scheduler is killed (500 tokens on the small model could both finish first).
    model_dir = model_dirs("llama_long_context")
    s = start_server(model_dir, "--max-total-tokens", "16384")
    try:
        info = s.info()
        sp = scheduler_pid(info)
        assert isinstance(sp, int) and sp != s.proc.pid and pid_alive(sp), info
        model = str(model_dir)
        res: dict = {"stream_lines": []}
        started = threading.Event()

        def non_stream():
            try:
                r = httpx.post(s.url + "/generate", headers=s.headers, timeout=30.0,
                               json={"text": "in flight", "sampling_params": dict(GREEDY, max_new_tokens=7000)})
                res["plain"] = (r.status_code, r.text, time.monotonic())
            except Exception as exc:
                res["plain_exc"] = repr(exc)

        def stream():
            try:
                with httpx.stream("POST", s.url + "/v1/chat/completions", headers=s.headers, timeout=30.0,
                                  json={"model": model, "messages": [{"role": "user", "content": "x"}],
                                        "max_tokens": 7000, "temperature": 0, "ignore_eos": True,
                                        "stream": True}) as r:
                    res["stream_status"] = r.status_code
                    for line in r.iter_lines():
                        res["stream_lines"].append(line)
                        if line.startswith("data:"):
                            started.set()
                res["stream_end"] = time.monotonic()
            except Exception as exc:
                res["stream_exc"] = repr(exc)
            finally:
                started.set()

        threads = [threading.Thread(target=f, daemon=True) for f in (non_stream, stream)]
        for t in threads:
            t.start()
        assert started.wait(30), "stream never started"
        wait_until(lambda: s.state()["num_running_reqs"] >= 2, 10.0,
                   what=lambda: f"both requests running (state: {s.state()})")
        s.remember_pids()
        t_kill = time.monotonic()
        os.kill(sp, signal.SIGKILL)
        for t in threads:
            t.join(15)
        assert not any(t.is_alive() for t in threads), f"requests hang after the scheduler died: {res}"
        assert "plain_exc" not in res and "stream_exc" not in res, res

        status, text, t_end = res["plain"]
        assert 500 <= status < 600, (status, text[:500])
        assert "error" in json.loads(text), text[:500]
        assert t_end - t_kill < 12, t_end - t_kill

        assert res["stream_status"] == 200
        events, done = parse_sse_lines(res["stream_lines"])
        assert done, f"stream did not end with [DONE]: {res['stream_lines'][-3:]}"
        assert any("error" in e for e in events), events[-3:]
        assert res["stream_end"] - t_kill < 12

        wait_until(lambda: httpx.get(s.url + "/health", timeout=5.0).status_code == 503, 10.0, step=0.2,
                   what="/health 503 after the scheduler died")
        r = httpx.get(s.url + "/health_generate", timeout=15.0)
        assert r.status_code == 503, (r.status_code, r.text[:300])
        # A new request fails at once too.
        t0 = time.monotonic()
        r = httpx.post(s.url + "/generate", headers=s.headers, timeout=15.0,
                       json={"text": "after", "sampling_params": {"max_new_tokens": 2}})
        assert 500 <= r.status_code < 600 and "error" in r.json(), (r.status_code, r.text[:300])
        assert time.monotonic() - t0 < 10
        graceful, alive = s.terminate()
        assert graceful, "server needed SIGKILL after the scheduler died"
        assert not alive, f"children left after shutdown: {sorted(alive)}"
    finally:
        s.close()


# ---- shutdown ----------------------------------------------------------------------------------
def test_sigterm_leaves_no_process(start_server, llama_dir, server_flags):
    s = start_server(llama_dir, *server_flags)
    try:
        info = s.info()
        pids = set(info["pids"])
        assert pids, info
        r = s.client.post("/generate", json={"text": "hi", "sampling_params": dict(GREEDY, max_new_tokens=3)})
        assert r.status_code == 200, r.text
        # Shut down with a request in flight.
        res: dict = {}

        def inflight():
            try:
                r = httpx.post(s.url + "/generate", timeout=30.0,
                               json={"text": "x", "sampling_params": dict(GREEDY, max_new_tokens=500)})
                res["status"] = r.status_code
            except httpx.HTTPError as exc:
                res["exc"] = repr(exc)

        t = threading.Thread(target=inflight, daemon=True)
        t.start()
        wait_until(lambda: s.state()["num_running_reqs"] > 0, 10.0, what="the request in flight running")
        known = s.remember_pids()
        assert pids <= known | pids
        graceful, alive = s.terminate()
        assert graceful, f"server did not exit within 15s of SIGTERM:\n{s.output()[-3000:]}"
        assert not alive, f"children alive after SIGTERM: {sorted(alive)}"
        assert not [p for p in pids if pid_alive(p)]
        t.join(10)
        assert not t.is_alive(), "in-flight client still hangs after the server exited"
    finally:
        s.close()
