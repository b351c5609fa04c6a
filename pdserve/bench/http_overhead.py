"""Latency the HTTP path adds: the same requests, one at a time, through the
offline Engine and through a running server (/generate and /v1/completions).

    python -m pdserve.bench.http_overhead --num-requests 50 --output-len 16
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _report(name: str, xs: list[float], base: list[float] | None = None) -> None:
    mean = statistics.mean(xs) * 1000
    line = f"{name:28s} mean {mean:7.2f} ms  p50 {_percentile(xs, 0.5) * 1000:7.2f}  p99 {_percentile(xs, 0.99) * 1000:7.2f}"
    if base is not None:
        line += f"  (+{mean - statistics.mean(base) * 1000:.2f} ms over the engine)"
    print(line)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: a tiny random Llama built here")
    ap.add_argument("--num-requests", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    args = ap.parse_args(argv)

    from pdserve import Engine
    from pdserve.bench.offline_throughput import make_prompts
    from pdserve.scheduler.worker import free_tcp_port
    from pdserve.testing import build_random_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_path) if args.model_path else build_random_model(
            Path(tmp) / "m", "llama", hidden_size=128, num_layers=4)
        prompts = make_prompts(args.num_requests, args.prompt_len, args.prompt_len, 90, 0)
        params = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
        common = ["--max-total-tokens", "16384", "--disable-radix-cache"]
        with Engine(model_path=str(model_dir), max_total_tokens=16384, disable_radix_cache=True) as engine:
            engine.generate(input_ids=prompts[0], sampling_params=params)
            offline = []
            for p in prompts:
                t0 = time.perf_counter()
                engine.generate(input_ids=p, sampling_params=params)
                offline.append(time.perf_counter() - t0)
        port = free_tcp_port()
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.launch_server", "--model-path", str(model_dir),
                                 "--port", str(port), "--log-level", "warning", *common],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            with httpx.Client(timeout=60) as client:
                for _ in range(600):
                    try:
                        if client.get(f"{url}/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.2)
                client.post(f"{url}/generate", json={"input_ids": prompts[0], "sampling_params": params})
                native, openai = [], []
                for p in prompts:
                    t0 = time.perf_counter()
                    client.post(f"{url}/generate", json={"input_ids": p, "sampling_params": params}).raise_for_status()
                    native.append(time.perf_counter() - t0)
                for p in prompts:
                    t0 = time.perf_counter()
                    client.post(f"{url}/v1/completions", json={
                        "prompt": p, "max_tokens": args.output_len, "temperature": 0,
                        "ignore_eos": True}).raise_for_status()
                    openai.append(time.perf_counter() - t0)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    print(f"{args.num_requests} sequential requests, {args.prompt_len} prompt tokens, "
          f"{args.output_len} output tokens, {os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    _report("offline Engine.generate", offline)
    _report("server POST /generate", native, offline)
    _report("server POST /v1/completions", openai, offline)


if __name__ == "__main__":
    main()
