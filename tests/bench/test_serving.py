"""The serving benchmark (`python -m pdserve.bench.serving`): metric math on synthetic
timings, the arrival schedule and concurrency bound against a mock transport, SSE
parsing per backend, the dataset loaders, and short runs against a real pdserve server
on the demo model for each backend."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from typing import Any

import httpx
import numpy as np
import pytest

from pdserve.bench import serving
from pdserve.bench.serving import BenchRequest, RequestRecord, compute_metrics


def rec(ttft: float, latency: float, output_len: int, itl: list[float] | None = None, prompt_len: int = 10,
        success: bool = True, **kw: Any) -> RequestRecord:
    return RequestRecord(success=success, error="" if success else "boom", prompt_len=prompt_len,
                         output_len=output_len, ttft=ttft, itl=list(itl or []), latency=latency, **kw)


# ---- metric math ---------------------------------------------------------------------------
@pytest.mark.fast
def test_metrics_match_numpy_on_known_arrays():
    records = [
        rec(0.10, 1.00, 10, [0.1] * 9, prompt_len=100),
        rec(0.20, 2.00, 5, [0.4, 0.5, 0.45, 0.45], prompt_len=50),
        rec(0.05, 0.50, 4, [0.15, 0.15, 0.15], prompt_len=20),
        rec(0.30, 0.30, 1, [], prompt_len=7),  # one token: no TPOT, no ITL
        rec(0.01, 0.02, 0, [], prompt_len=999, success=False),
        rec(9.0, 9.0, 99, [9.0], prompt_len=999, success=False),
    ]
    m = compute_metrics(records, duration=4.0)
    ok = records[:4]
    ttft = np.array([r.ttft for r in ok]) * 1000
    e2e = np.array([r.latency for r in ok]) * 1000
    tpot = np.array([(r.latency - r.ttft) / (r.output_len - 1) for r in ok[:3]]) * 1000
    itl = np.array([g for r in ok for g in r.itl]) * 1000
    assert (m.completed, m.failed) == (4, 2)
    assert m.total_input == 177 and m.total_output == 20
    approx = pytest.approx
    assert m.mean_ttft_ms == approx(ttft.mean()) and m.median_ttft_ms == approx(np.median(ttft))
    assert m.p99_ttft_ms == approx(np.percentile(ttft, 99)) and m.std_ttft_ms == approx(ttft.std())
    assert m.mean_e2e_latency_ms == approx(e2e.mean()) and m.median_e2e_latency_ms == approx(np.median(e2e))
    assert m.p90_e2e_latency_ms == approx(np.percentile(e2e, 90))
    assert m.p99_e2e_latency_ms == approx(np.percentile(e2e, 99))
    assert m.mean_tpot_ms == approx(tpot.mean()) and m.median_tpot_ms == approx(np.median(tpot))
    assert m.p99_tpot_ms == approx(np.percentile(tpot, 99))
    assert m.mean_tpot_ms == approx(np.mean([100.0, 450.0, 150.0]))  # (E2E - TTFT) / (n - 1), by hand
    assert m.mean_itl_ms == approx(itl.mean()) and m.median_itl_ms == approx(np.median(itl))
    assert m.p95_itl_ms == approx(np.percentile(itl, 95)) and m.p99_itl_ms == approx(np.percentile(itl, 99))
    assert m.max_itl_ms == approx(500.0)
    # Totals over the duration; concurrency = sum of E2E / duration.
    assert m.request_throughput == approx(1.0)
    assert m.input_throughput == approx(177 / 4) and m.output_throughput == approx(20 / 4)
    assert m.total_throughput == approx(197 / 4)
    assert m.concurrency == approx((1.0 + 2.0 + 0.5 + 0.3) / 4)
    assert m.duration == 4.0 and m.accept_length is None


@pytest.mark.fast
def test_metrics_of_nothing_and_of_failures_only_are_zeros():
    for records in ([], [rec(1.0, 2.0, 5, [0.1], success=False)]):
        m = compute_metrics(records, duration=0.0)
        assert m.completed == 0 and m.failed == len(records)
        assert m.mean_ttft_ms == m.p99_itl_ms == m.request_throughput == m.concurrency == 0.0
        assert m.total_output_retokenized is None
    text = serving.format_result(compute_metrics([rec(1, 2, 3, success=False)], 1.0), "pdserve", math.inf, None,
                                 "HTTP 500: x")
    assert "Failed requests:                         1" in text and "First error: HTTP 500: x" in text


@pytest.mark.fast
def test_accept_length_from_server_or_from_verify_counts():
    records = [rec(0.1, 1.0, 10, spec_verify_ct=4), rec(0.1, 1.0, 6, spec_verify_ct=4)]
    assert compute_metrics(records, 1.0).accept_length == pytest.approx(2.0)
    assert compute_metrics(records, 1.0, accept_length=3.25).accept_length == 3.25
    assert serving._accept_length_of({"avg_spec_accept_length": None, "decode": [{"avg_spec_accept_length": 2.5}]}) \
        == 2.5
    assert serving._accept_length_of({"internal_states": [{"avg_spec_accept_length": 1.75}]}) == 1.75
    assert serving._accept_length_of({"avg_spec_accept_length": None, "internal_state": {}}) is None
    text = serving.format_result(compute_metrics(records, 1.0), "pdserve", 4.0, 8)
    assert "Accept length:                           2.00" in text
    assert "Accept length" not in serving.format_result(compute_metrics([rec(0.1, 1, 3)], 1.0), "x", 1.0, None)


METRIC_LINES = (
    "Backend:", "Traffic request rate:", "Max request concurrency:", "Successful requests:",
    "Failed requests:", "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
    "Request throughput (req/s):", "Input token throughput (tok/s):", "Output token throughput (tok/s):",
    "Total token throughput (tok/s):", "Concurrency:",
    "Mean E2E Latency (ms):", "Median E2E Latency (ms):", "P99 E2E Latency (ms):",
    "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
    "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
    "Mean ITL (ms):", "Median ITL (ms):", "P95 ITL (ms):", "P99 ITL (ms):", "Max ITL (ms):",
)


def _block_values(text: str) -> dict[str, str]:
    """Metric name -> printed value of one result block."""
    out = {}
    for line in text.splitlines():
        if ":" in line and not line.startswith(("=", "-", "#")):
            name, _, value = line.partition(":")
            out[name.strip()] = value.strip()
    return out


@pytest.mark.fast
def test_result_block_has_sglangs_layout():
    m = compute_metrics([rec(0.1, 1.0, 10, [0.1] * 9)], 2.0)
    text = serving.format_result(m, "pdserve", math.inf, None)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============" and lines[-1] == "=" * 50
    for section in ("End-to-End Latency", "Time to First Token", "Time per Output Token (excl. 1st token)",
                    "Inter-Token Latency"):
        assert any(line.strip("-") == section and len(line) == 50 for line in lines), section
    for name in METRIC_LINES:
        assert sum(line.startswith(name) for line in lines) == 1, name
    v = _block_values(text)
    assert v["Traffic request rate"] == "inf" and v["Max request concurrency"] == "not set"
    assert v["Successful requests"] == "1" and v["Mean TTFT (ms)"] == "100.00"
    assert lines[4] == "{:<40} {:<10}".format("Successful requests:", 1)  # SGLang's column widths


# ---- arrivals and concurrency ------------------------------------------------------------------
@pytest.mark.fast
def test_poisson_schedule_is_deterministic_with_the_right_rate():
    a = serving.arrival_times(20000, 5.0, seed=7)
    assert a == serving.arrival_times(20000, 5.0, seed=7) and a != serving.arrival_times(20000, 5.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() == pytest.approx(0.2, rel=0.05)  # exponential: std = mean
    assert serving.arrival_times(5, math.inf, seed=1) == [0.0] * 5
    with pytest.raises(ValueError, match="--request-rate"):
        serving.arrival_times(3, 0.0, seed=1)


def sse_body(events: list[Any]) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def native_events(n: int, prompt_tokens: int = 5) -> list[Any]:
    return [{"text": "x" * (i + 1), "output_ids": list(range(i + 1)),
             "meta_info": {"prompt_tokens": prompt_tokens, "completion_tokens": i + 1, "cached_tokens": 0}}
            for i in range(n)] + ["[DONE]"]


class FakeServer:
    """A MockTransport handler: answers /generate after `delay` with `n` native chunks and
    counts the requests in flight. With `gate`, it answers none before `gate` requests are
    in flight at once (and fails them all after 30 s without)."""

    def __init__(self, delay: float = 0.05, n: int = 3, gate: int | None = None) -> None:
        self.delay, self.n, self.gate = delay, n, gate
        self.in_flight = self.max_in_flight = 0
        self.starts: list[float] = []
        self._all_in: asyncio.Event | None = None

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.starts.append(time.perf_counter())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                if self._all_in is None:
                    self._all_in = asyncio.Event()
                if self.in_flight >= self.gate:
                    self._all_in.set()
                await asyncio.wait_for(self._all_in.wait(), 30)
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        return httpx.Response(200, content=sse_body(native_events(self.n)))


def _run(requests: list[BenchRequest], fake: FakeServer, rate: float, max_concurrency: int | None
         ) -> serving.RunState:
    async def go() -> serving.RunState:
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake), base_url="http://fake") as client:
            return await serving.run_requests(
                requests, lambda r: serving.send_request(client, "pdserve", r), rate, max_concurrency, seed=3)
    return asyncio.run(go())


REQS = [BenchRequest("hi", 2, 3, prompt_ids=[5, 6]) for _ in range(12)]


@pytest.mark.fast
def test_max_concurrency_bounds_requests_in_flight():
    fake = FakeServer(delay=0.05)
    state = _run(REQS, fake, math.inf, max_concurrency=3)
    assert fake.max_in_flight == 3
    assert len(state.records) == 12 and all(r.success for r in state.records)
    # Four waves of three: the run takes at least 4 x delay.
    assert state.duration() >= 4 * 0.05


@pytest.mark.fast
def test_inf_rate_sends_everything_at_once():
    # Every request is sent before any is answered (none waits for another's answer) ...
    fake = FakeServer(delay=0.0, gate=len(REQS))
    state = _run(REQS, fake, math.inf, max_concurrency=None)
    assert fake.max_in_flight == 12
    assert len(state.records) == 12 and all(r.success for r in state.records)
    # ... and none after a pause: all go at offset 0 (seconds here would be a schedule).
    assert max(fake.starts) - min(fake.starts) < 2.0
    assert all(r.start_time < 2.0 for r in state.records)


@pytest.mark.fast
def test_requests_follow_the_poisson_schedule():
    fake = FakeServer(delay=0.0)
    state = _run(REQS, fake, 40.0, max_concurrency=None)
    planned = serving.arrival_times(12, 40.0, seed=3)
    starts = sorted(r.start_time for r in state.records)
    for s, p in zip(starts, planned):
        assert p - 1e-3 <= s < p + 0.1
    assert state.duration() >= planned[-1]


# ---- SSE parsing per backend ----------------------------------------------------------------------
def _send(backend: str, handler: Any, req: BenchRequest | None = None) -> RequestRecord:
    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://fake") as client:
            return await serving.send_request(client, backend, req or BenchRequest("hi", 2, 4), "m")
    return asyncio.run(go())


def _streaming(events: list[Any], first_delay: float = 0.0, gap: float = 0.0, seen: list | None = None) -> Any:
    async def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append((request.url.path, json.loads(request.content)))

        async def body():
            await asyncio.sleep(first_delay)
            for i, e in enumerate(events):
                if i:
                    await asyncio.sleep(gap)
                yield sse_body([e])
        return httpx.Response(200, content=body())
    return handler


@pytest.mark.fast
def test_native_stream_counts_tokens_from_meta_info_and_one_itl_per_chunk():
    events = [
        {"text": "a", "output_ids": [7], "meta_info": {"prompt_tokens": 9, "completion_tokens": 1,
                                                       "cached_tokens": 4}},
        {"text": "abc", "output_ids": [7, 8, 9], "meta_info": {"prompt_tokens": 9, "completion_tokens": 3}},
        {"text": "abcd", "output_ids": [7, 8, 9, 2], "meta_info": {"prompt_tokens": 9, "completion_tokens": 4}},
        {"text": "abcd", "output_ids": [7, 8, 9, 2], "meta_info": {"prompt_tokens": 9, "completion_tokens": 4,
                                                                   "finish_reason": {"type": "length"}}},
        "[DONE]",
    ]
    seen: list = []
    r = _send("pdserve", _streaming(events, first_delay=0.05, gap=0.03, seen=seen),
              BenchRequest("hi", 2, 4, prompt_ids=[1, 2]))
    assert r.success, r.error
    assert seen[0][0] == "/generate" and seen[0][1]["stream"] is True and seen[0][1]["input_ids"] == [1, 2]
    assert seen[0][1]["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    assert r.output_len == 4 and r.prompt_len == 9 and r.generated_text == "abcd" and r.cached_tokens == 4
    assert r.ttft >= 0.05
    assert len(r.itl) == 2 and all(g >= 0.025 for g in r.itl)  # the 2-token chunk is one gap; finish is none
    assert r.latency >= r.ttft + sum(r.itl)


@pytest.mark.fast
def test_openai_streams_take_output_len_from_usage():
    comp = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", "", "bc", "d")]
    comp.append({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 6,
                                          "prompt_tokens_details": {"cached_tokens": 3}}})
    seen: list = []
    r = _send("openai", _streaming([*comp, "[DONE]"], seen=seen))
    assert r.success and r.output_len == 6 and r.prompt_len == 11 and r.cached_tokens == 3
    assert len(r.itl) == 2 and r.generated_text == "abcd"  # the empty chunk is no content
    body = seen[0][1]
    assert seen[0][0] == "/v1/completions" and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m" and body["max_tokens"] == 4 and body["prompt"] == "hi"

    chat = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            *[{"choices": [{"index": 0, "delta": {"content": t}}]} for t in ("x", "yz")],
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 3}}, "[DONE]"]
    seen = []
    r = _send("openai-chat", _streaming(chat, seen=seen))
    assert r.success and r.output_len == 3 and r.prompt_len == 8 and len(r.itl) == 1
    assert seen[0][0] == "/v1/chat/completions"
    assert seen[0][1]["messages"] == [{"role": "user", "content": "hi"}]
    assert seen[0][1]["stream_options"] == {"include_usage": True}


@pytest.mark.fast
def test_failed_requests_say_why():
    def status(code: int) -> Any:
        return lambda request: httpx.Response(code, json={"error": {"message": "too long"}})
    r = _send("openai", status(400))
    assert not r.success and r.error.startswith("HTTP 400") and "too long" in r.error
    r = _send("pdserve", _streaming([native_events(1)[0], {"error": {"message": "scheduler died"}}, "[DONE]"]))
    assert not r.success and r.error == "scheduler died"
    r = _send("pdserve", _streaming(native_events(2)[:-1]))  # no [DONE]: cut short
    assert not r.success and "[DONE]" in r.error

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")
    r = _send("openai-chat", refuse)
    assert not r.success and "ConnectError" in r.error
    # A failed request is a record, not an exception, and the run counts it.
    m = compute_metrics([r, rec(0.1, 1, 3)], 1.0)
    assert (m.completed, m.failed) == (1, 1)


# ---- datasets -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_tokenizer():
    from pdserve import assets
    from pdserve.tokenizer import load_tokenizer
    return load_tokenizer(assets.path("demo"))


@pytest.mark.fast
def test_random_dataset_lengths_within_the_range_ratio(demo_tokenizer):
    reqs = serving.random_dataset(200, 40, 20, 0.5, demo_tokenizer, seed=5)
    assert len(reqs) == 200
    special = set(demo_tokenizer.all_special_ids)
    for r in reqs:
        assert 20 <= r.prompt_len <= 40 and 10 <= r.output_len <= 20
        assert len(r.prompt_ids) == r.prompt_len and not special & set(r.prompt_ids)
        assert r.text == demo_tokenizer.decode(r.prompt_ids)
    assert {r.prompt_len for r in reqs} >= {20, 40}  # both ends reached
    assert [r.prompt_ids for r in reqs] == [r.prompt_ids for r in serving.random_dataset(200, 40, 20, 0.5,
                                                                                          demo_tokenizer, seed=5)]
    exact = serving.random_dataset(10, 7, 3, 1.0, demo_tokenizer, seed=1)
    assert {(r.prompt_len, r.output_len) for r in exact} == {(7, 3)}
    with pytest.raises(ValueError, match="--random-range-ratio"):
        serving.random_dataset(1, 7, 3, 1.5, demo_tokenizer)


@pytest.mark.fast
def test_sharegpt_parsing(tmp_path, demo_tokenizer):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is 1 + 2?"},
                                      {"from": "gpt", "value": "1 + 2 = 3"}, {"from": "human", "value": "ok"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "Repeat: ab"},
                                      {"from": "gpt", "value": "ab cd"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "no answer"}]},
        {"id": "d", "conversations": [{"from": "gpt", "value": "gpt first"}, {"from": "human", "value": "?"}]},
        {"id": "e", "conversations": [{"from": "human", "value": "short"}, {"from": "gpt", "value": "x"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = serving.sharegpt_dataset(path, 10, demo_tokenizer, seed=0)
    n = lambda s: len(demo_tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    # c and d have no human -> gpt pair; e's reply is one token (< 2).
    assert sorted((r.text, r.prompt_len, r.output_len) for r in reqs) == sorted([
        ("What is 1 + 2?", n("What is 1 + 2?"), n("1 + 2 = 3")), ("Repeat: ab", n("Repeat: ab"), n("ab cd"))])
    fixed = serving.sharegpt_dataset(path, 10, demo_tokenizer, seed=0, output_len=7)
    assert len(fixed) == 3 and {r.output_len for r in fixed} == {7}  # e is kept with an override
    assert len(serving.sharegpt_dataset(path, 1, demo_tokenizer, seed=0)) == 1
    too_long = n("What is 1 + 2?") + n("1 + 2 = 3")
    assert len(serving.sharegpt_dataset(path, 10, demo_tokenizer, context_len=too_long - 1)) == 1
    path.write_text(json.dumps([data[2]]))
    with pytest.raises(ValueError, match="no usable"):
        serving.sharegpt_dataset(path, 10, demo_tokenizer)


@pytest.mark.fast
def test_multiturn_measured_prompts_extend_the_warmup_prompts(demo_tokenizer):
    from pdserve.assets import demo_tasks

    warm, measured = serving.multiturn_dataset(5, 3, demo_tokenizer, seed=2)
    assert len(warm) == len(measured) == 5
    assert (warm, measured) == serving.multiturn_dataset(5, 3, demo_tokenizer, seed=2)
    for w, m in zip(warm, measured):
        assert sum(x["role"] == "user" for x in w.messages) == 3 and sum(x["role"] == "user" for x in m.messages) == 4
        assert m.messages[:len(w.messages)] == w.messages and w.messages[0]["role"] == "system"
        assert m.prompt_ids[:len(w.prompt_ids)] == w.prompt_ids and len(m.prompt_ids) > len(w.prompt_ids)
        assert m.text.startswith(w.text) and w.prompt_len == len(w.prompt_ids)
        # Realistic turns: the demo tasks' questions, answered with their reference answers.
        assert all(any(x["content"].startswith(p) for p in ("What is", "Repeat:", "Remember:"))
                   for x in m.messages if x["role"] == "user")
        answer = m.messages[len(w.messages)]["content"]
        assert w.output_len == len(demo_tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1
    systems = {w.messages[0]["content"] for w in warm}
    assert systems <= set(demo_tasks.SYSTEM_PROMPTS)
    # Conversations share their system prompt's tokens with others: a cross-conversation prefix.
    assert len(systems) < 5
    w2, _ = serving.multiturn_dataset(2, 1, None, seed=2, output_len=6)  # no tokenizer: plain text, chat only
    assert w2[0].prompt_ids is None and w2[0].output_len == 6 and w2[0].text.endswith("assistant: ")


# ---- the command line -------------------------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("argv,flag", [
    (["--num-prompts", "0"], "--num-prompts"), (["--request-rate", "0"], "--request-rate"),
    (["--max-concurrency", "0"], "--max-concurrency"), (["--random-range-ratio", "2"], "--random-range-ratio"),
    (["--dataset-name", "sharegpt"], "--dataset-path"), (["--extra-request-body", "[1]"], "--extra-request-body"),
    (["--backend", "vllm"], "--backend"),
])
def test_bad_arguments_are_refused(argv, flag, capsys):
    with pytest.raises(SystemExit):
        serving.parse_args(argv)
    assert flag in capsys.readouterr().err


@pytest.mark.fast
def test_plot_without_matplotlib_fails_first_with_a_clear_message(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc = serving.main(["--base-url", "http://127.0.0.1:1", "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "--plot needs matplotlib" in err and "pip install matplotlib" in err


@pytest.mark.fast
def test_plot_writes_a_png(tmp_path):
    records = [rec(0.1 * i, 1.0 + i, 5, [0.05 * i] * 4) for i in range(1, 6)]
    serving.plot_latencies({"a": records, "b": records[:2]}, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.fast
def test_unreachable_server_is_a_clear_error(capsys):
    rc = serving.main(["--base-url", "http://127.0.0.1:1", "--backend", "openai", "--disable-tqdm"])
    assert rc == 2 and "cannot list the models" in capsys.readouterr().err


# ---- against a real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    from pdserve import assets
    from tests.server.conftest import ServerProcess

    s = ServerProcess(assets.path("demo"))
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("backend", serving.BACKENDS)
def test_run_against_pdserve(server, backend, tmp_path, capsys):
    out = tmp_path / "res.jsonl"
    argv = ["--base-url", server.url, "--backend", backend, "--dataset-name", "random", "--num-prompts", "4",
            "--random-input-len", "24", "--random-output-len", "6", "--random-range-ratio", "0.5",
            "--request-rate", "50", "--max-concurrency", "3", "--disable-tqdm", "--output-file", str(out)]
    assert serving.main(argv) == 0
    printed = capsys.readouterr().out
    for name in (*METRIC_LINES, "Total generated tokens (retokenized):"):
        assert sum(line.startswith(name) for line in printed.splitlines()) == 1, (name, printed)
    v = _block_values(printed)
    assert v["Backend"] == backend and v["Successful requests"] == "4" and v["Failed requests"] == "0"
    assert v["Traffic request rate"] == "50.0" and v["Max request concurrency"] == "3"
    assert int(v["Total input tokens"]) >= 4 * 12 and 4 * 3 <= int(v["Total generated tokens"]) <= 4 * 6
    for name in ("Benchmark duration (s)", "Request throughput (req/s)", "Output token throughput (tok/s)",
                 "Concurrency", "Mean E2E Latency (ms)", "Mean TTFT (ms)", "Mean TPOT (ms)", "Mean ITL (ms)"):
        assert float(v[name]) > 0, (name, printed)
    assert float(v["Mean TTFT (ms)"]) <= float(v["Mean E2E Latency (ms)"])
    assert float(v["Concurrency"]) <= 3.01
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["completed"] == 4 and record["failed"] == 0 and record["backend"] == backend
    assert record["model"] == server.client.get("/v1/models").json()["data"][0]["id"]
    assert record["request_rate"] == 50.0
    assert record["args"]["num_prompts"] == 4 and record["total_output"] == int(v["Total generated tokens"])
    if backend == "pdserve":  # input ids go as they are: the server counts exactly the dataset's tokens
        assert 4 * 12 <= record["total_input"] <= 4 * 24


def test_multiturn_measured_round_hits_the_prefix_cache(server, tmp_path, capsys):
    out = tmp_path / "res.jsonl"
    argv = ["--base-url", server.url, "--backend", "openai-chat", "--dataset-name", "multiturn",
            "--num-conversations", "3", "--turns", "2", "--seed", "11", "--warmup-requests", "0",
            "--disable-tqdm", "--output-file", str(out), "--output-details"]
    assert serving.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.index("# Round 1 (warm-up)") < printed.index("# Round 2 (measured)")
    assert printed.count("============ Serving Benchmark Result ============") == 2
    warm, measured = [json.loads(line) for line in out.read_text().splitlines()]
    assert (warm["round"], measured["round"]) == ("Round 1 (warm-up)", "Round 2 (measured)")
    assert warm["completed"] == measured["completed"] == 3
    assert len(measured["ttfts"]) == 3 and measured["errors"] == ["", "", ""]
    # The measured prompts extend the warm-up's, which the server has cached by then.
    assert measured["total_cached_tokens"] >= 0.8 * warm["total_input"]
    assert measured["total_input"] > warm["total_input"]
