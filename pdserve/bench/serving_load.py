"""The load side of the serving benchmark (serving.py): what one request is, how it is
sent and timed, and how a round's requests are sent on a schedule.

Backends: ``pdserve`` (native ``/generate`` streaming: cumulative ``output_ids`` /
``text`` plus ``meta_info``), ``openai`` (``/v1/completions``) and ``openai-chat``
(``/v1/chat/completions``), both streaming with ``stream_options.include_usage``.
Arrivals are a Poisson process of ``--request-rate`` (all at once for ``inf``), with at
most ``--max-concurrency`` requests in flight.

Split from serving.py (the CLI and the benchmark's rounds), from the datasets that make
the requests (serving_datasets.py) and from the metrics and report computed from the
records (serving_metrics.py): this module is the only one that talks to the server under
load, and the records it fills are all the others read.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import httpx
import numpy as np

BACKENDS = ("pdserve", "openai", "openai-chat")


class BenchError(RuntimeError):
    """A benchmark that cannot run (bad arguments, unreachable server, no tokenizer, ...)."""


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
