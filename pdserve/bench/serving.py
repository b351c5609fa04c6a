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

The metrics are SGLang's ``calculate_metrics`` (defined in serving_metrics.py).
"""
# Layout: this module is the CLI and the benchmark's rounds (setup, warm-up, reporting);
# the load it sends (requests, backends, arrivals) is serving_load.py's, the datasets
# serving_datasets.py's, the metrics, result block and plots serving_metrics.py's. Their
# public names are importable from here as before.

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
from typing import Any, Awaitable

import httpx
import numpy as np

from pdserve.bench.serving_datasets import _n_tokens, multiturn_dataset, random_dataset, sharegpt_dataset
from pdserve.bench.serving_load import (BACKENDS, BenchError, BenchRequest, RequestRecord, RunState, SendFn,
                                        arrival_times, build_payload, run_requests, send_request)
from pdserve.bench.serving_metrics import (Metrics, _import_pyplot, _jsonable, compute_metrics, format_result,
                                           plot_latencies)

__all__ = ["BACKENDS", "DATASETS", "BenchError", "BenchRequest", "Benchmark", "Metrics", "RequestRecord", "Round",
           "RunState", "SendFn", "arrival_times", "build_payload", "compute_metrics", "first_model_id",
           "format_result", "main", "multiturn_dataset", "parse_args", "plot_latencies", "random_dataset",
           "run_requests", "send_request", "server_accept_length", "server_tokenizer_path", "sharegpt_dataset"]

DATASETS = ("random", "sharegpt", "multiturn")
REQUEST_TIMEOUT_S = 6 * 3600.0  # SGLang's AIOHTTP_TIMEOUT: a long request is not a failure
INFO_TIMEOUT_S = 30.0


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
