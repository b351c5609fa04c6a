"""SGLang-native routes: /generate (equal to Engine.generate), streaming, logprobs,
/health, /health_generate, /get_server_info, /flush_cache, /metrics, /abort_request."""

from __future__ import annotations

import math
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import GREEDY, random_prompts
from tests.server.conftest import MAX_TOTAL_TOKENS, parse_sse_lines, pid_alive, scheduler_pid
from tests.waiting import wait_until

TEXTS = ["The quick brown fox", "Hello, my name is", "1, 2, 3, 4,"]
IDS = random_prompts(3, 5, 40, seed=3)


def post(server, path, body, **kw):
    r = server.client.post(path, json=body, **kw)
    assert r.status_code == 200, (path, body, r.status_code, r.text[:1000])
    return r.json()


def same_result(got, want, logprobs=False):
    assert got["text"] == want["text"]
    assert got["output_ids"] == want["output_ids"]
    gm, wm = got["meta_info"], want["meta_info"]
    for key in ("prompt_tokens", "completion_tokens", "finish_reason"):
        assert gm[key] == wm[key], (key, gm[key], wm[key])
    assert isinstance(gm["id"], str) and gm["id"]
    assert isinstance(gm["cached_tokens"], int) and 0 <= gm["cached_tokens"] <= gm["prompt_tokens"]
    if logprobs:
        g = gm["output_token_logprobs"]
        w = wm["output_token_logprobs"]
        assert [t for _, t, _ in g] == [t for _, t, _ in w]
        for (glp, _, _), (wlp, _, _) in zip(g, w):
            assert math.isclose(glp, wlp, abs_tol=1e-3), (glp, wlp)


# ---- /generate --------------------------------------------------------------------------
def test_generate_single_text(server, engine):
    params = dict(GREEDY, max_new_tokens=12)
    ref = engine.generate(TEXTS[0], params)
    out = post(server, "/generate", {"text": TEXTS[0], "sampling_params": params})
    assert isinstance(out, dict)
    same_result(out, ref)
    # Without ignore_eos, default params bar max_new_tokens: equal too.
    params = {"temperature": 0, "max_new_tokens": 10}
    same_result(post(server, "/generate", {"text": TEXTS[1], "sampling_params": params}),
                engine.generate(TEXTS[1], params))


def test_generate_batch_text_and_ids(server, engine):
    params = dict(GREEDY, max_new_tokens=8)
    refs = engine.generate(TEXTS, params)
    out = post(server, "/generate", {"text": TEXTS, "sampling_params": params})
    assert isinstance(out, list) and len(out) == len(TEXTS)
    for got, want in zip(out, refs):
        same_result(got, want)
    refs = engine.generate(input_ids=IDS, sampling_params=params)
    out = post(server, "/generate", {"input_ids": IDS, "sampling_params": params})
    assert isinstance(out, list) and len(out) == len(IDS)
    for got, want in zip(out, refs):
        same_result(got, want)
    single = post(server, "/generate", {"input_ids": IDS[0], "sampling_params": params})
    assert isinstance(single, dict)
    same_result(single, refs[0])
    assert len({o["meta_info"]["id"] for o in out}) == len(out)


def test_generate_per_prompt_sampling_params(server, engine):
    params = [dict(GREEDY, max_new_tokens=n) for n in (3, 7, 5)]
    refs = engine.generate(TEXTS, params)
    out = post(server, "/generate", {"text": TEXTS, "sampling_params": params})
    assert [o["meta_info"]["completion_tokens"] for o in out] == [3, 7, 5]
    for got, want in zip(out, refs):
        same_result(got, want)


def test_generate_n_seeded_equals_engine(server, engine):
    params = {"temperature": 1.0, "n": 3, "seed": 7, "max_new_tokens": 10, "ignore_eos": True}
    refs = engine.generate(input_ids=IDS[0], sampling_params=params)
    out = post(server, "/generate", {"input_ids": IDS[0], "sampling_params": params})
    assert isinstance(out, list) and len(out) == 3
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in refs]


def test_generate_return_logprob(server, engine):
    params = dict(GREEDY, max_new_tokens=6)
    ref = engine.generate(TEXTS[2], params, return_logprob=True, top_logprobs_num=3)
    out = post(server, "/generate", {"text": TEXTS[2], "sampling_params": params,
                                     "return_logprob": True, "top_logprobs_num": 3})
    same_result(out, ref, logprobs=True)
    top = out["meta_info"]["output_top_logprobs"]
    assert len(top) == 6
    for step, chosen in zip(top, out["output_ids"]):
        assert len(step) == 3
        assert step[0][1] == chosen  # greedy: the top entry is the chosen token
        assert step[0][0] >= step[1][0] >= step[2][0]
    plain = post(server, "/generate", {"text": TEXTS[2], "sampling_params": params})
    assert "output_token_logprobs" not in plain["meta_info"] or \
        not plain["meta_info"]["output_token_logprobs"]


def stream_generate(server, body, timeout=60.0):
    with server.client.stream("POST", "/generate", json=dict(body, stream=True), timeout=timeout) as r:
        assert r.status_code == 200, (r.status_code, r.read()[:1000])
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        return parse_sse_lines(r.iter_lines())


def test_generate_stream_cumulative(server, engine):
    # Updates the handler has not taken yet are merged, and the tiny model makes 16
    # tokens in a few ms: long enough that the stream cannot all be made before its
    # handler first wakes.
    params = dict(GREEDY, max_new_tokens=160)
    ref = engine.generate(TEXTS[0], params)
    events, done = stream_generate(server, {"text": TEXTS[0], "sampling_params": params})
    assert done, "stream did not end with data: [DONE]"
    assert len(events) >= 2, events
    texts = [e["text"] for e in events]
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a), f"stream text is not cumulative: {a!r} then {b!r}"
    assert texts[-1] == ref["text"]
    last = events[-1]
    assert last["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    assert last["meta_info"]["completion_tokens"] == 160
    if "output_ids" in last:
        assert last["output_ids"] == ref["output_ids"]


def test_generate_stream_n_samples_are_distinguishable(server, engine):
    """With n > 1 every streamed chunk must say which sample it belongs to (SGLang: `index`)."""
    params = {"temperature": 1.0, "n": 2, "seed": 3, "max_new_tokens": 6, "ignore_eos": True}
    refs = engine.generate(input_ids=IDS[1], sampling_params=params)
    assert refs[0]["text"] != refs[1]["text"]
    events, done = stream_generate(server, {"input_ids": IDS[1], "sampling_params": params})
    assert done
    keys = {(e["meta_info"]["id"], e.get("index")) for e in events}
    assert len(keys) == 2, f"chunks of the 2 samples cannot be told apart: {sorted(map(str, keys))}"
    finals = {}
    for e in events:
        finals[(e["meta_info"]["id"], e.get("index"))] = e["text"]
    assert sorted(finals.values()) == sorted(r["text"] for r in refs)


# ---- health & info -----------------------------------------------------------------------
def test_health_routes(server):
    assert server.client.get("/health").status_code == 200
    r = server.client.get("/health_generate", timeout=30.0)
    assert r.status_code == 200, r.text


def test_server_info_shape(server, llama_dir):
    info = server.info()
    args = info["server_args"]
    assert isinstance(args, dict)
    assert args["model_path"] == str(llama_dir)
    assert args["max_total_tokens"] == MAX_TOTAL_TOKENS
    pids = info["pids"]
    assert isinstance(pids, list) and pids and all(isinstance(p, int) for p in pids)
    assert all(pid_alive(p) for p in pids), pids
    sp = scheduler_pid(info)
    assert isinstance(sp, int) and pid_alive(sp)
    assert sp in pids
    assert sp != server.proc.pid, "the scheduler should be its own process"
    st = info["internal_state"]
    mem = st["memory"]
    for key in ("kv_pages_total", "kv_pages_free", "kv_pages_evictable", "req_slots_total",
                "req_slots_free"):
        assert isinstance(mem[key], int) and mem[key] >= 0, (key, mem)
    assert mem["kv_pages_free"] <= mem["kv_pages_total"]
    assert mem["req_slots_free"] <= mem["req_slots_total"]
    assert isinstance(st["num_running_reqs"], int) and isinstance(st["num_waiting_reqs"], int)


def test_flush_cache(server):
    prompt = "cache me " * 10
    params = dict(GREEDY, max_new_tokens=2)
    post(server, "/generate", {"text": prompt, "sampling_params": params})
    again = post(server, "/generate", {"text": prompt, "sampling_params": params})
    assert again["meta_info"]["cached_tokens"] > 0
    server.wait_idle()
    mem = server.state()["memory"]
    assert mem["kv_pages_evictable"] > 0, mem
    r = server.client.post("/flush_cache")
    assert r.status_code == 200, r.text
    mem = server.state()["memory"]
    assert mem["kv_pages_free"] == mem["kv_pages_total"], mem
    assert mem["kv_pages_evictable"] == 0, mem
    after = post(server, "/generate", {"text": prompt, "sampling_params": params})
    assert after["meta_info"]["cached_tokens"] == 0


# ---- metrics ---------------------------------------------------------------------------------
REQUIRED_METRICS = [
    "pdserve:num_running_reqs", "pdserve:num_queue_reqs", "pdserve:token_usage",
    "pdserve:cache_hit_rate", "pdserve:time_to_first_token_seconds",
    "pdserve:inter_token_latency_seconds", "pdserve:e2e_request_latency_seconds",
    "pdserve:prompt_tokens_total", "pdserve:generation_tokens_total",
]


def scrape(server):
    r = server.client.get("/metrics")
    assert r.status_code == 200, r.text
    families = list(text_string_to_metric_families(r.text))
    names = {f.name for f in families}
    samples = {}
    for f in families:
        for s in f.samples:
            # Sum over label sets.
            samples[s.name] = samples.get(s.name, 0.0) + s.value
    return names, samples


def test_metrics(server):
    names, before = scrape(server)
    present = names | set(before)
    missing = [m for m in REQUIRED_METRICS if m not in present]
    assert not missing, f"missing metrics {missing}; have {sorted(present)}"
    assert all(n.startswith("pdserve:") for n in names if not n.startswith(("python_", "process_")))
    params = dict(GREEDY, max_new_tokens=5)
    out = post(server, "/generate", {"input_ids": IDS[1], "sampling_params": params})
    assert out["meta_info"]["completion_tokens"] == 5
    # At least this much more of each, once the request is counted.
    want = {"pdserve:prompt_tokens_total": len(IDS[1]), "pdserve:generation_tokens_total": 5,
            "pdserve:e2e_request_latency_seconds_count": 1, "pdserve:time_to_first_token_seconds_count": 1}

    def grown() -> dict:
        _, after = scrape(server)
        return {name: after.get(name, 0) - before.get(name, 0) for name in want}
    wait_until(lambda: all(d >= want[name] for name, d in grown().items()), 10.0, step=0.2,
               what=lambda: f"metrics grown by {want} (grew by {grown()})")


# ---- abort ---------------------------------------------------------------------------------------
def test_abort_request(server):
    rid = "abort-me-123"
    body = {"text": "long running", "rid": rid, "stream": True,
            "sampling_params": dict(GREEDY, max_new_tokens=600)}
    events: list = []
    result: dict = {}

    def reader():
        try:
            with httpx.stream("POST", server.url + "/generate", json=body, headers=server.headers,
                              timeout=60.0) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    result.setdefault("lines", []).append(line)
        except Exception as exc:  # reported below
            result["exc"] = repr(exc)

    t = threading.Thread(target=reader, daemon=True)
    t.start()

    def three_events() -> bool:
        if len([x for x in result.get("lines", []) if x.startswith("data:")]) >= 3:
            return True
        assert t.is_alive(), result
        return False
    wait_until(three_events, 30.0, what=lambda: f"3 events of the stream ({result})")
    r = server.client.post("/abort_request", json={"rid": rid})
    assert r.status_code == 200, r.text
    t.join(15)
    assert not t.is_alive(), "stream did not end after /abort_request"
    assert "exc" not in result, result
    events, done = parse_sse_lines(result["lines"])
    assert done
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
    assert last["meta_info"]["completion_tokens"] < 600
    server.wait_idle(5)
    server.assert_pools_full()


def test_abort_non_streaming_request(server):
    rid = "abort-me-too"
    result: dict = {}
    budget = 1000  # about 2 s of decoding here; the context is 1024

    def call():
        r = httpx.post(server.url + "/generate", headers=server.headers, timeout=60.0,
                       json={"text": "x", "rid": rid, "sampling_params": dict(GREEDY, max_new_tokens=budget)})
        result["status"], result["body"] = r.status_code, r.text
    t = threading.Thread(target=call, daemon=True)
    t.start()
    # Abort it as soon as the scheduler runs it: one round trip, far less than the budget's
    # decode time. (Waiting for the token counter too once let a fast machine finish first.)
    wait_until(lambda: server.state()["num_running_reqs"] > 0, 20.0, step=0.01,
               what="the request running")
    assert server.client.post("/abort_request", json={"rid": rid}).status_code == 200
    t.join(15)
    assert not t.is_alive(), "request did not end after /abort_request"
    # SGLang answers an aborted request with its partial result (finish_reason abort).
    import json as _json
    body = _json.loads(result["body"])
    if result["status"] == 200:
        assert body["meta_info"]["finish_reason"]["type"] == "abort", body
        assert body["meta_info"]["completion_tokens"] < budget
    else:
        assert "error" in body and result["status"] < 500, result
    server.assert_pools_full()


def test_engine_flags_pass_through(start_server, llama_dir, engine):
    """Engine flags reach the scheduler: a small paged pool with chunked prefill forces
    chunking and retraction, and greedy outputs still equal the reference."""
    import asyncio

    s = start_server(llama_dir, "--max-total-tokens", "400", "--page-size", "4",
                     "--chunked-prefill-size", "32", "--max-running-requests", "6")
    try:
        args = s.info()["server_args"]
        assert (args["max_total_tokens"], args["page_size"], args["chunked_prefill_size"],
                args["max_running_requests"]) == (400, 4, 32, 6)
        mem = s.state()["memory"]
        assert mem["req_slots_total"] >= 6 and mem["kv_pages_total"] * 4 <= 400 + 8, mem
        prompts = random_prompts(10, 50, 90, seed=77)
        params = dict(GREEDY, max_new_tokens=30)
        refs = engine.generate(input_ids=prompts, sampling_params=params)

        async def run():
            async with httpx.AsyncClient(base_url=s.url, timeout=120.0) as c:
                rs = await asyncio.gather(*[c.post("/generate", json={"input_ids": p, "sampling_params": params})
                                            for p in prompts])
            return rs
        rs = asyncio.run(run())
        for r, ref in zip(rs, refs):
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == ref["output_ids"]
        s.assert_pools_full()
    finally:
        s.close()
