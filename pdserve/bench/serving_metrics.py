"""The results side of the serving benchmark (serving.py): SGLang's metrics from the
per-request records, its printed result block, the JSONL form and the latency plots.

Definitions (SGLang's ``calculate_metrics``): TTFT is the time to the first chunk that
carries content; ITL the gaps between content chunks (one per chunk, also when a chunk
carries several tokens); TPOT = (E2E - TTFT) / (output_len - 1) for output_len > 1;
output_len is the server's completion token count; throughputs are totals over the
benchmark duration; Concurrency = sum of E2E latencies / duration.  Failed requests
are counted and reported, and left out of every latency and token statistic.

Split from the load (serving_load.py) because it is pure: it reads records, whoever
made them (report.py's HF-generate row computes the same metrics from its own timings).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from pdserve.bench.serving_load import BenchError, RequestRecord


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


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # inf request rate: "inf", as JSON has no infinity
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


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
