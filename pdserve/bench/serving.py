"""Online serving benchmark, in the shape of SGLang's ``python -m sglang.bench_serving``.

Streams requests at a server (a colocated pdserve server, the PD router, or any
SGLang / OpenAI-compatible server) with Poisson arrivals and prints SGLang's result
block (same metric names and layout): throughputs, concurrency, E2E latency, TTFT,
TPOT and ITL.

    python -m pdserve.bench.serving --base-url http://127.0.0.1:30000 --backend pdserve \\
        --dataset-name random --random-input-len 256 --random-output-len 64 \\
        --num-prompts 100 --request-rate 8 --max-concurrency 16

Backends: ``pdserve`` (native ``/generate`` streaming: cumulative ``output_ids`` /
``text`` plus ``meta_info``), ``openai`` (``/v1/completions``) and ``openai-chat``
(``/v1/chat/completions``), both streaming with ``stream_options.include_usage``.

Datasets: ``random`` (token ids drawn from the server tokenizer's vocabulary, lengths
uniform in [len * ratio, len]), ``sharegpt`` (a local ShareGPT JSON: the first human
turn is the prompt, the gpt reply's token count the output length) and ``multiturn``
(chat conversations built from the demo model's tasks, run as a warm-up round and a
measured round whose prompts extend the warm-up's, so the prefix cache shows).

Definitions (SGLang's ``calculate_metrics``): TTFT is the time to the first chunk that
carries content; ITL the gaps between content chunks (one per chunk, also when a chunk
carries several tokens); TPOT = (E2E - TTFT) / (output_len - 1) for output_len > 1;
output_len is the server's completion token count; throughputs are totals over the
benchmark duration; Concurrency = sum of E2E latencies / duration.  Failed requests
are counted and reported, and left out of every latency and token statistic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Awaitable, Callable, Sequence

import httpx
import numpy as np

BACKENDS = ("pdserve", "openai", "openai-chat")
DATASETS = ("random", "sharegpt", "multiturn")
REQUEST_TIMEOUT_S = 6 * 3600.0  # SGLang's AIOHTTP_TIMEOUT: a long request is not a failure
INFO_TIMEOUT_S = 30.0


class BenchError(RuntimeError):
    """A benchmark that cannot run (bad arguments, unreachable server, no tokenizer, ...)."""


# ---- requests and records ------------------------------------------------------------
@dataclass
class BenchRequest:
    """One request of a dataset. ``prompt_ids`` (exact tokens) is sent when the backend
    takes token ids; ``messages`` is what the chat backend sends (default: ``text`` as
    one user message)."""

    text: str
    prompt_len: int  # the dataset's count; replaced by the server's when it reports one
    output_len: int  # max tokens asked for
    prompt_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None


@dataclass
class RequestRecord:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0  # the server's completion token count
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds, one per content chunk after the first
    latency: float = 0.0  # E2E seconds
    start_time: float = 0.0  # seconds after the benchmark started
    generated_text: str = ""
    cached_tokens: int | None = None
    spec_verify_ct: int | None = None
    output_len_retokenized: int | None = None


# ---- metrics (pure) --------------------------------------------------------------------
@dataclass
class Metrics:
    """SGLang's ``BenchmarkMetrics`` names; latencies in milliseconds."""

    completed: int
    failed: int
    duration: float  # seconds
    total_input: int
    total_output: int
    total_output_retokenized: int | None
    total_cached_tokens: int | None
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    accept_length: float | None
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p90_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float


def _stats(xs: Sequence[float]) -> dict[str, float]:
    """mean / median / std / percentiles / max of ``xs`` in ms (0 for an empty list, as SGLang)."""
    if len(xs) == 0:
        return {k: 0.0 for k in ("mean", "median", "std", "p90", "p95", "p99", "max")}
    a = np.asarray(xs, dtype=np.float64) * 1000.0
    return {"mean": float(np.mean(a)), "median": float(np.median(a)), "std": float(np.std(a)),
            "p90": float(np.percentile(a, 90)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99)), "max": float(np.max(a))}


def compute_metrics(records: Sequence[RequestRecord], duration: float,
                    accept_length: float | None = None) -> Metrics:
    """The benchmark's metrics from per-request records and the wall time (seconds)."""
    ok = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    retok = None
    if ok and all(r.output_len_retokenized is not None for r in ok):
        retok = sum(r.output_len_retokenized or 0 for r in ok)
    cached = None
    if ok and all(r.cached_tokens is not None for r in ok):
        cached = sum(r.cached_tokens or 0 for r in ok)
    e2e = [r.latency for r in ok]
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itl = [g for r in ok for g in r.itl]
    if accept_length is None:
        # Without the server's figure: tokens per verify step, from the requests' meta_info.
        verify = [r for r in ok if r.spec_verify_ct]
        if verify:
            accept_length = sum(r.output_len for r in verify) / sum(r.spec_verify_ct or 0 for r in verify)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    s_e2e, s_ttft, s_tpot, s_itl = _stats(e2e), _stats(ttft), _stats(tpot), _stats(itl)
    return Metrics(
        completed=len(ok), failed=len(records) - len(ok), duration=duration,
        total_input=total_input, total_output=total_output, total_output_retokenized=retok,
        total_cached_tokens=cached,
        request_throughput=per_s(len(ok)), input_throughput=per_s(total_input),
        output_throughput=per_s(total_output), total_throughput=per_s(total_input + total_output),
        concurrency=per_s(sum(e2e)), accept_length=accept_length,
        mean_e2e_latency_ms=s_e2e["mean"], median_e2e_latency_ms=s_e2e["median"], std_e2e_latency_ms=s_e2e["std"],
        p90_e2e_latency_ms=s_e2e["p90"], p99_e2e_latency_ms=s_e2e["p99"],
        mean_ttft_ms=s_ttft["mean"], median_ttft_ms=s_ttft["median"], std_ttft_ms=s_ttft["std"],
        p99_ttft_ms=s_ttft["p99"],
        mean_tpot_ms=s_tpot["mean"], median_tpot_ms=s_tpot["median"], std_tpot_ms=s_tpot["std"],
        p99_tpot_ms=s_tpot["p99"],
        mean_itl_ms=s_itl["mean"], median_itl_ms=s_itl["median"], std_itl_ms=s_itl["std"],
        p95_itl_ms=s_itl["p95"], p99_itl_ms=s_itl["p99"], max_itl_ms=s_itl["max"],
    )


def format_result(m: Metrics, backend: str, request_rate: float, max_concurrency: int | None,
                  first_error: str | None = None) -> str:
    """SGLang's printed result block."""
    lines: list[str] = []

    def title(s: str, c: str) -> None:
        lines.append("{s:{c}^{n}}".format(s=s, n=50, c=c))

    def row(name: str, value: Any) -> None:
        if isinstance(value, float):
            lines.append("{:<40} {:<10.2f}".format(name + ":", value))
        else:
            lines.append("{:<40} {:<10}".format(name + ":", value))

    title(" Serving Benchmark Result ", "=")
    row("Backend", backend)
    row("Traffic request rate", str(request_rate))  # SGLang prints the raw value: 8.0, inf
    row("Max request concurrency", max_concurrency if max_concurrency else "not set")
    row("Successful requests", m.completed)
    row("Failed requests", m.failed)
    row("Benchmark duration (s)", m.duration)
    row("Total input tokens", m.total_input)
    row("Total generated tokens", m.total_output)
    if m.total_output_retokenized is not None:
        row("Total generated tokens (retokenized)", m.total_output_retokenized)
    row("Request throughput (req/s)", m.request_throughput)
    row("Input token throughput (tok/s)", m.input_throughput)
    row("Output token throughput (tok/s)", m.output_throughput)
    row("Total token throughput (tok/s)", m.total_throughput)
    row("Concurrency", m.concurrency)
    if m.accept_length is not None:
        row("Accept length", float(m.accept_length))
    title("End-to-End Latency", "-")
    row("Mean E2E Latency (ms)", m.mean_e2e_latency_ms)
    row("Median E2E Latency (ms)", m.median_e2e_latency_ms)
    row("P90 E2E Latency (ms)", m.p90_e2e_latency_ms)
    row("P99 E2E Latency (ms)", m.p99_e2e_latency_ms)
    title("Time to First Token", "-")
    row("Mean TTFT (ms)", m.mean_ttft_ms)
    row("Median TTFT (ms)", m.median_ttft_ms)
    row("P99 TTFT (ms)", m.p99_ttft_ms)
    title("Time per Output Token (excl. 1st token)", "-")
    row("Mean TPOT (ms)", m.mean_tpot_ms)
    row("Median TPOT (ms)", m.median_tpot_ms)
    row("P99 TPOT (ms)", m.p99_tpot_ms)
    title("Inter-Token Latency", "-")
    row("Mean ITL (ms)", m.mean_itl_ms)
    row("Median ITL (ms)", m.median_itl_ms)
    row("P95 ITL (ms)", m.p95_itl_ms)
    row("P99 ITL (ms)", m.p99_itl_ms)
    row("Max ITL (ms)", m.max_itl_ms)
    title("", "=")
    if m.failed and first_error:
        lines.append(f"First error: {first_error}")
    return "\n".join(lines)


# ---- arrivals ----------------------------------------------------------------------------
def arrival_times(n: int, request_rate: float, seed: int) -> list[float]:
    """Send offsets (seconds after the start) of ``n`` requests: a Poisson process of
    ``request_rate`` per second (exponential gaps, deterministic for ``seed``; the first
    request goes at 0), or all at 0 for ``inf``."""
    if request_rate <= 0 or math.isnan(request_rate):
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


# ---- the HTTP side ---------------------------------------------------------------------------
def build_payload(backend: str, req: BenchRequest, model: str | None, ignore_eos: bool = True,
                  extra_body: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one streaming request: greedy, ``output_len`` new tokens."""
    if backend == "pdserve":
        body: dict[str, Any] = {"sampling_params": {"temperature": 0.0, "max_new_tokens": req.output_len,
                                                    "ignore_eos": ignore_eos}, "stream": True}
        if req.prompt_ids is not None:
            body["input_ids"] = req.prompt_ids
        else:
            body["text"] = req.text
        path = "/generate"
    elif backend == "openai":
        body = {"prompt": req.prompt_ids if req.prompt_ids is not None else req.text, "temperature": 0.0,
                "max_tokens": req.output_len, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": ignore_eos}
        path = "/v1/completions"
    elif backend == "openai-chat":
        messages = req.messages if req.messages is not None else [{"role": "user", "content": req.text}]
        body = {"messages": messages, "temperature": 0.0, "max_tokens": req.output_len, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
        path = "/v1/chat/completions"
    else:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if model and backend != "pdserve":
        body["model"] = model
    if extra_body:
        body.update(extra_body)
    return path, body


def _error_message(ev: Any) -> str:
    err = ev.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


async def send_request(client: httpx.AsyncClient, backend: str, req: BenchRequest, model: str | None = None,
                       ignore_eos: bool = True, extra_body: dict[str, Any] | None = None) -> RequestRecord:
    """Stream one request; never raises for a failed request (the record says why)."""
    path, payload = build_payload(backend, req, model, ignore_eos, extra_body)
    rec = RequestRecord(prompt_len=req.prompt_len)
    st = time.perf_counter()
    rec.start_time = st
    last = st
    first_seen = False
    done = False
    tokens_seen = 0  # pdserve: completion tokens so far
    content_chunks = 0
    text_parts: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", path, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:500]}"
                rec.latency = time.perf_counter() - st
                return rec
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                ev = json.loads(data)
                if isinstance(ev, dict) and "error" in ev:
                    rec.error = _error_message(ev)
                    break
                has_content = False
                if backend == "pdserve":
                    meta = ev.get("meta_info") or {}
                    n = int(meta.get("completion_tokens", len(ev.get("output_ids") or [])))
                    if n > tokens_seen:
                        has_content = True
                        tokens_seen = n
                    text_parts = [ev.get("text") or ""]  # cumulative
                    if "prompt_tokens" in meta:
                        rec.prompt_len = int(meta["prompt_tokens"])
                    if meta.get("cached_tokens") is not None:
                        rec.cached_tokens = int(meta["cached_tokens"])
                    if meta.get("spec_verify_ct"):
                        rec.spec_verify_ct = int(meta["spec_verify_ct"])
                else:
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for ch in ev.get("choices") or []:
                        piece = ch.get("text") if backend == "openai" else (ch.get("delta") or {}).get("content")
                        if piece:
                            has_content = True
                            text_parts.append(piece)
                if has_content:
                    content_chunks += 1
                    if not first_seen:
                        first_seen = True
                        rec.ttft = now - st
                    else:
                        rec.itl.append(now - last)
                    last = now
        rec.latency = time.perf_counter() - st
    except Exception as exc:  # connection refused, reset, bad JSON, timeouts: a failed request
        rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        rec.latency = time.perf_counter() - st
        return rec
    rec.generated_text = "".join(text_parts)
    if backend == "pdserve":
        rec.output_len = tokens_seen
    elif usage is not None:
        rec.output_len = int(usage.get("completion_tokens") or 0)
        if usage.get("prompt_tokens") is not None:
            rec.prompt_len = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    else:  # a server that ignores include_usage: one token per content chunk is the best guess
        rec.output_len = content_chunks
    if rec.error:
        return rec
    if not done:
        rec.error = "the stream ended before data: [DONE]"
    elif rec.output_len <= 0:
        rec.error = "no tokens generated"
    else:
        if not first_seen:  # tokens without text (e.g. only special tokens)
            rec.ttft = rec.latency
        rec.success = True
    return rec


SendFn = Callable[[BenchRequest], Awaitable[RequestRecord]]


@dataclass
class RunState:
    """What a round has finished so far (read after Ctrl-C)."""

    total: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    start: float | None = None
    end: float | None = None

    def duration(self) -> float:
        if self.start is None:
            return 0.0
        return (self.end if self.end is not None else time.perf_counter()) - self.start


async def run_requests(requests: Sequence[BenchRequest], send: SendFn, request_rate: float = math.inf,
                       max_concurrency: int | None = None, seed: int = 1, state: RunState | None = None,
                       progress: Any = None) -> RunState:
    """Send ``requests`` on the arrival schedule, at most ``max_concurrency`` in flight;
    records go to ``state`` in completion order as they finish."""
    state = state if state is not None else RunState()
    state.total = len(requests)
    times = arrival_times(len(requests), request_rate, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    state.start = start = time.perf_counter()

    async def one(at: float, req: BenchRequest) -> None:
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is not None:
            async with sem:
                rec = await send(req)
        else:
            rec = await send(req)
        rec.start_time -= start
        state.records.append(rec)
        if progress is not None:
            progress.update(1)

    await asyncio.gather(*(one(at, r) for at, r in zip(times, requests)))
    state.end = time.perf_counter()
    return state


# ---- datasets ----------------------------------------------------------------------------------
def _special_ids(tokenizer: Any) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", None) or [])


def _n_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float, tokenizer: Any,
                   seed: int = 1) -> list[BenchRequest]:
    """Prompts of random non-special token ids; input and output lengths uniform over
    [max(1, int(len * range_ratio)), len] (range_ratio 1 = exact lengths)."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = np.random.default_rng(seed)
    special = _special_ids(tokenizer)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
    if len(vocab) == 0:
        raise ValueError("the tokenizer has no non-special tokens")
    in_lens = rng.integers(max(1, int(input_len * range_ratio)), input_len + 1, size=num_prompts)
    out_lens = rng.integers(max(1, int(output_len * range_ratio)), output_len + 1, size=num_prompts)
    out = []
    for il, ol in zip(in_lens.tolist(), out_lens.tolist()):
        ids = rng.choice(vocab, size=il).tolist()
        out.append(BenchRequest(text=tokenizer.decode(ids), prompt_len=il, output_len=ol, prompt_ids=ids))
    return out


def _turn_role(turn: dict[str, Any]) -> str:
    return str(turn.get("from", turn.get("role", ""))).lower()


def sharegpt_dataset(path: str | os.PathLike[str], num_prompts: int, tokenizer: Any, seed: int = 1,
                     output_len: int | None = None, context_len: int | None = None) -> list[BenchRequest]:
    """Requests from a ShareGPT JSON (a list of ``{"conversations": [{"from": "human"|"gpt",
    "value": ...}, ...]}``): the first human turn is the prompt and the gpt turn after it
    sets the output length (``output_len`` overrides).  Entries without such a pair,
    with fewer than 2 output tokens, or longer than ``context_len`` are skipped; the
    rest are shuffled with ``seed`` and the first ``num_prompts`` kept."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of ShareGPT entries")
    pairs: list[tuple[str, str]] = []
    for entry in data:
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conv, list):
            continue
        for i, turn in enumerate(conv[:-1]):
            if isinstance(turn, dict) and _turn_role(turn) in ("human", "user"):
                nxt = conv[i + 1]
                if isinstance(nxt, dict) and _turn_role(nxt) in ("gpt", "assistant", "chatgpt", "bard"):
                    pairs.append((str(turn.get("value", "")), str(nxt.get("value", ""))))
                break
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(out) >= num_prompts:
            break
        p_len = _n_tokens(tokenizer, prompt)
        o_len = output_len if output_len is not None else _n_tokens(tokenizer, reply)
        if p_len < 1 or o_len < (1 if output_len is not None else 2):
            continue
        if context_len is not None and p_len + o_len > context_len:
            continue
        out.append(BenchRequest(text=prompt, prompt_len=p_len, output_len=o_len))
    if not out:
        raise ValueError(f"{path}: no usable ShareGPT conversation (human turn followed by a gpt turn)")
    return out


def _render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[int] | None]:
    """The chat-templated prompt and its tokens (plain "role: content" lines without a template)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return text, (tokenizer(text, add_special_tokens=False)["input_ids"] if tokenizer is not None else None)


def multiturn_dataset(num_conversations: int, turns: int, tokenizer: Any, seed: int = 1,
                      output_len: int | None = None) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warm-up round, measured round) of chat conversations built from the demo model's
    tasks (``pdserve.assets.demo_tasks``, training split: questions it knows).

    Each conversation starts with a system prompt shared by many conversations.  The
    warm-up prompt holds ``turns`` user turns (the earlier ones answered with their
    reference answers); the measured prompt is the warm-up prompt with the last question
    answered plus one new question, so its rendered prompt extends the warm-up's.  The
    output length is the reference answer's tokens + 1 (its end of turn) unless given."""
    from pdserve.assets import demo_tasks

    if num_conversations < 1 or turns < 1:
        raise ValueError("--num-conversations and --turns must be >= 1")
    warm, measured = [], []
    for c in range(num_conversations):
        rng = random.Random(f"bench-serving-multiturn-{seed}-{c}")
        system = rng.choice(demo_tasks.SYSTEM_PROMPTS)
        examples = [demo_tasks.sample_example(rng, rng.choice(demo_tasks.TASKS), "train")
                    for _ in range(turns + 1)]
        msgs: list[dict[str, str]] = [{"role": "system", "content": system}]
        for ex in examples[:-1]:
            msgs += [{"role": "user", "content": ex.question}, {"role": "assistant", "content": ex.answer}]
        warm_msgs = msgs[:-1]  # ends with question number `turns`
        measured_msgs = msgs + [{"role": "user", "content": examples[-1].question}]
        for round_msgs, ex, dest in ((warm_msgs, examples[-2], warm), (measured_msgs, examples[-1], measured)):
            text, ids = _render_chat(tokenizer, round_msgs)
            o_len = output_len
            if o_len is None:
                o_len = (_n_tokens(tokenizer, ex.answer) if tokenizer is not None else len(ex.answer)) + 1
            dest.append(BenchRequest(text=text, prompt_len=len(ids) if ids is not None else len(text),
                                     output_len=o_len, prompt_ids=ids, messages=round_msgs))
    return warm, measured


# ---- server information -------------------------------------------------------------------------
async def _get_json(client: httpx.AsyncClient, path: str) -> Any:
    r = await client.get(path, timeout=INFO_TIMEOUT_S)
    r.raise_for_status()
    return r.json()


async def first_model_id(client: httpx.AsyncClient) -> str:
    data = await _get_json(client, "/v1/models")
    models = data.get("data") or []
    if not models:
        raise BenchError("/v1/models lists no model; give --model")
    return str(models[0]["id"])


async def server_tokenizer_path(client: httpx.AsyncClient) -> str:
    """Where the server's tokenizer lives: /get_model_info's tokenizer_path or model_path,
    the embedded demo model when neither is set."""
    info = await _get_json(client, "/get_model_info")
    path = info.get("tokenizer_path") or info.get("model_path")
    if not path:
        from pdserve import assets
        return str(assets.path("demo"))
    return str(path)


def _accept_length_of(info: Any) -> float | None:
    """SGLang's places for it: top level, internal_states[0], internal_state, decode[0] (PD)."""
    if not isinstance(info, dict):
        return None
    candidates = [info.get("avg_spec_accept_length")]
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        candidates.append(states[0].get("avg_spec_accept_length"))
    if isinstance(info.get("internal_state"), dict):
        candidates.append(info["internal_state"].get("avg_spec_accept_length"))
    decodes = info.get("decode")
    if isinstance(decodes, list) and decodes and isinstance(decodes[0], dict):
        candidates.append(decodes[0].get("avg_spec_accept_length"))
    for c in candidates:
        if isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0:
            return float(c)
    return None


async def server_accept_length(client: httpx.AsyncClient) -> float | None:
    try:
        return _accept_length_of(await _get_json(client, "/get_server_info"))
    except (httpx.HTTPError, ValueError):
        return None


# ---- plotting -------------------------------------------------------------------------------------
def _import_pyplot() -> Any:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError("--plot needs matplotlib, which is not a pdserve dependency: "
                         f"pip install matplotlib ({exc})") from None
    return plt


def plot_latencies(rounds: dict[str, Sequence[RequestRecord]], path: str | os.PathLike[str]) -> None:
    """Histograms (top) and CDFs (bottom) of TTFT, ITL and E2E latency, one series per round."""
    plt = _import_pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for col, (name, get) in enumerate((
            ("TTFT (ms)", lambda ok: [r.ttft * 1000 for r in ok]),
            ("ITL (ms)", lambda ok: [g * 1000 for r in ok for g in r.itl]),
            ("E2E latency (ms)", lambda ok: [r.latency * 1000 for r in ok]))):
        series = {label: np.sort(np.asarray(get([r for r in records if r.success]), dtype=np.float64))
                  for label, records in rounds.items()}
        every = np.concatenate([xs for xs in series.values()] + [np.zeros(0)])
        if len(every):  # the same bins for every round, so the histograms compare
            bins = np.histogram_bin_edges(every, bins=min(50, max(5, len(every) // 4)))
        for label, xs in series.items():
            if len(xs) == 0:
                continue
            axes[0][col].hist(xs, bins=bins, alpha=0.6, label=label)
            axes[1][col].plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
        axes[0][col].set_title(name)
        axes[0][col].set_ylabel("requests" if col != 1 else "gaps")
        axes[1][col].set_xlabel(name)
        axes[1][col].set_ylabel("CDF")
        axes[1][col].grid(alpha=0.3)
        if len(rounds) > 1:
            axes[0][col].legend()
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)


# ---- the benchmark -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.serving", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:30000", help="server or router root URL")
    ap.add_argument("--backend", choices=BACKENDS, default="pdserve")
    ap.add_argument("--model", default=None, help="model field of OpenAI requests (default: first of /v1/models)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer directory (default: the server's, from /get_model_info)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="Bearer token (default: $OPENAI_API_KEY)")
    ap.add_argument("--dataset-name", choices=DATASETS, default="random")
    ap.add_argument("--dataset-path", default=None, help="ShareGPT JSON (--dataset-name sharegpt)")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=1024)
    ap.add_argument("--random-range-ratio", type=float, default=0.0,
                    help="lengths are uniform over [len * ratio, len]")
    ap.add_argument("--sharegpt-output-len", type=int, default=None,
                    help="output length of every ShareGPT request (default: the gpt reply's)")
    ap.add_argument("--num-conversations", type=int, default=None,
                    help="multiturn conversations (requests per round; default: --num-prompts)")
    ap.add_argument("--turns", type=int, default=3, help="multiturn: user turns in the warm-up round's prompt")
    ap.add_argument("--multiturn-output-len", type=int, default=None,
                    help="multiturn output length (default: the reference answer's tokens + 1)")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests per second, Poisson arrivals; inf sends all at once")
    ap.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup-requests", type=int, default=1, help="unmeasured requests sent first")
    ap.add_argument("--disable-ignore-eos", action="store_true",
                    help="let requests stop at EOS (default: exactly the output length)")
    ap.add_argument("--extra-request-body", default=None, help="JSON object merged into every request body")
    ap.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the measured run")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--output-file", default=None, help="append one JSONL record (metrics + args) per round")
    ap.add_argument("--output-details", action="store_true", help="also write per-request timings")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="TTFT / ITL / E2E histograms and CDFs")
    args = ap.parse_args(argv)
    if args.num_prompts < 1:
        ap.error("--num-prompts must be >= 1")
    if not args.request_rate > 0:
        ap.error("--request-rate must be > 0 (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be >= 1")
    if args.warmup_requests < 0:
        ap.error("--warmup-requests must be >= 0")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        ap.error("--random-range-ratio must be in [0, 1]")
    if args.random_input_len < 1 or args.random_output_len < 1:
        ap.error("--random-input-len and --random-output-len must be >= 1")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        ap.error("--dataset-name sharegpt needs --dataset-path (a local ShareGPT JSON)")
    if args.turns < 1 or (args.num_conversations is not None and args.num_conversations < 1):
        ap.error("--turns and --num-conversations must be >= 1")
    if args.extra_request_body is not None:
        try:
            args.extra_body = json.loads(args.extra_request_body)
        except ValueError as exc:
            ap.error(f"--extra-request-body: not JSON: {exc}")
        if not isinstance(args.extra_body, dict):
            ap.error("--extra-request-body must be a JSON object")
    else:
        args.extra_body = None
    return args


@dataclass
class Round:
    name: str  # "" for a single-round benchmark
    requests: list[BenchRequest]
    state: RunState = field(default_factory=RunState)
    metrics: Metrics | None = None


class Benchmark:
    def __init__(self, args: argparse.Namespace, client: httpx.AsyncClient | None = None) -> None:
        self.args = args
        self.client = client
        self.model: str | None = args.model
        self.tokenizer: Any = None
        self.rounds: list[Round] = []
        self.current: Round | None = None

    # -- setup --
    async def _load_tokenizer(self, required: bool) -> Any:
        from pdserve.tokenizer import load_tokenizer

        path = self.args.tokenizer
        try:
            if path is None:
                path = await server_tokenizer_path(self.client)
            if not os.path.isdir(path):
                raise BenchError(f"tokenizer {path!r} is not a local directory; give --tokenizer")
            return load_tokenizer(path)
        except (BenchError, httpx.HTTPError, ValueError) as exc:
            if required:
                raise BenchError(f"cannot load the tokenizer ({exc}); give --tokenizer DIR") from None
            return None

    async def _context_len(self) -> int | None:
        try:
            data = await _get_json(self.client, "/v1/models")
            return int(data["data"][0]["max_model_len"])
        except Exception:
            return None

    async def prepare(self) -> None:
        a = self.args
        if self.model is None:
            try:
                self.model = await first_model_id(self.client)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                if a.backend != "pdserve":
                    raise BenchError(f"cannot list the models at {a.base_url}/v1/models ({exc}); "
                                     "is the server up? (or give --model)") from None
        if a.dataset_name == "random":
            self.tokenizer = await self._load_tokenizer(required=True)
            reqs = random_dataset(a.num_prompts, a.random_input_len, a.random_output_len, a.random_range_ratio,
                                  self.tokenizer, a.seed)
            self.rounds = [Round("", reqs)]
        elif a.dataset_name == "sharegpt":
            self.tokenizer = await self._load_tokenizer(required=True)
            reqs = sharegpt_dataset(a.dataset_path, a.num_prompts, self.tokenizer, a.seed, a.sharegpt_output_len,
                                    await self._context_len())
            if len(reqs) < a.num_prompts:
                print(f"warning: {a.dataset_path} gives {len(reqs)} usable prompts, fewer than --num-prompts "
                      f"{a.num_prompts}", file=sys.stderr)
            self.rounds = [Round("", reqs)]
        else:
            self.tokenizer = await self._load_tokenizer(required=a.backend != "openai-chat")
            warm, measured = multiturn_dataset(a.num_conversations or a.num_prompts, a.turns, self.tokenizer,
                                               a.seed, a.multiturn_output_len)
            self.rounds = [Round("Round 1 (warm-up)", warm), Round("Round 2 (measured)", measured)]

    def send(self, req: BenchRequest) -> Awaitable[RequestRecord]:
        a = self.args
        return send_request(self.client, a.backend, req, self.model, not a.disable_ignore_eos, a.extra_body)

    async def warmup(self) -> None:
        n = self.args.warmup_requests
        if n == 0:
            return
        first = self.rounds[0].requests[0]
        test = BenchRequest(first.text, first.prompt_len, min(first.output_len, 32), first.prompt_ids,
                            first.messages)
        recs = await asyncio.gather(*(self.send(test) for _ in range(n)))
        bad = [r for r in recs if not r.success]
        if bad:
            raise BenchError(f"warm-up request failed, check the arguments and the server: {bad[0].error}")

    async def run(self) -> None:
        from tqdm import tqdm

        a = self.args
        await self.prepare()
        await self.warmup()
        if a.flush_cache:
            r = await self.client.post("/flush_cache", timeout=INFO_TIMEOUT_S)
            if r.status_code != 200:
                print(f"warning: /flush_cache answered {r.status_code}: {r.text.strip()}", file=sys.stderr)
        for rnd in self.rounds:
            self.current = rnd
            with tqdm(total=len(rnd.requests), disable=a.disable_tqdm, file=sys.stderr,
                      desc=rnd.name or None) as bar:
                await run_requests(rnd.requests, self.send, a.request_rate, a.max_concurrency, a.seed,
                                   rnd.state, bar)
            self.finish_round(rnd, await server_accept_length(self.client))
        self.current = None

    # -- results --
    def finish_round(self, rnd: Round, accept_length: float | None) -> None:
        if self.tokenizer is not None:
            for r in rnd.state.records:
                if r.success and r.output_len_retokenized is None:
                    r.output_len_retokenized = _n_tokens(self.tokenizer, r.generated_text)
        rnd.metrics = compute_metrics(rnd.state.records, rnd.state.duration(), accept_length)

    def report(self, rnd: Round, interrupted: bool = False) -> str:
        assert rnd.metrics is not None
        a = self.args
        first_error = next((r.error for r in rnd.state.records if not r.success), None)
        head = []
        if rnd.name:
            head.append(f"# {rnd.name}")
        if interrupted:
            head.append(f"Interrupted: {len(rnd.state.records)} of {rnd.state.total} requests finished "
                        "(the rest are not counted)")
        block = format_result(rnd.metrics, a.backend, a.request_rate, a.max_concurrency, first_error)
        return "\n".join([*head, block])

    def record(self, rnd: Round, interrupted: bool = False) -> dict[str, Any]:
        assert rnd.metrics is not None
        a = self.args
        rec: dict[str, Any] = {
            "date": datetime.now().isoformat(timespec="seconds"), "backend": a.backend,
            "dataset_name": a.dataset_name, "round": rnd.name or None, "model": self.model,
            "request_rate": a.request_rate, "max_concurrency": a.max_concurrency,
            "interrupted": interrupted, "num_requests": rnd.state.total, **asdict(rnd.metrics),
            "args": {k: v for k, v in vars(a).items() if k not in ("extra_body", "api_key")},
        }
        if a.output_details:
            recs = rnd.state.records
            rec.update(input_lens=[r.prompt_len for r in recs], output_lens=[r.output_len for r in recs],
                       ttfts=[r.ttft for r in recs], itls=[r.itl for r in recs],
                       e2e_latencies=[r.latency for r in recs], start_times=[r.start_time for r in recs],
                       errors=[r.error for r in recs])
        return rec


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # inf request rate: "inf", as JSON has no infinity
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


async def _run_with_client(bench: Benchmark) -> None:
    a = bench.args
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    # No pool cap: httpx's default of 100 connections would silently bound concurrency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=INFO_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=a.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=timeout) as client:
        bench.client = client
        await bench.run()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        try:
            _import_pyplot()  # fail before the benchmark, not after it
        except BenchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    bench = Benchmark(args)
    random.seed(args.seed)
    np.random.seed(args.seed)
    interrupted = False
    try:
        asyncio.run(_run_with_client(bench))
    except KeyboardInterrupt:
        interrupted = True
        rnd = bench.current
        if rnd is not None:
            rnd.state.end = time.perf_counter()
            bench.finish_round(rnd, None)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    done = [r for r in bench.rounds if r.metrics is not None]
    if interrupted and not done:
        print("Interrupted before any request finished.", file=sys.stderr)
        return 130
    for rnd in done:
        cut = interrupted and rnd is bench.current
        print(bench.report(rnd, cut))
        print()
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            for rnd in done:
                f.write(json.dumps(_jsonable(bench.record(rnd, interrupted and rnd is bench.current))) + "\n")
    if args.plot:
        plot_latencies({(r.name or "all"): r.state.records for r in done}, args.plot)
        print(f"Plot written to {args.plot}")
    if interrupted:
        return 130
    return 1 if any(r.metrics and r.metrics.failed for r in done) else 0


if __name__ == "__main__":
    sys.exit(main())
