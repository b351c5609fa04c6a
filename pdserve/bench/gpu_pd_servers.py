"""The two-server GPU proof of disaggregation (the servers step of scripts/gpu_proof.sh; issue 23).

Real processes, as users run them: ``pdserve up`` deployments on one device, the
router in front, KV moving between the servers through Mooncake (the non-CUDA
build stages KV through host buffers on a GPU; ``--disaggregation-kv-staging
auto`` picks that and says so in the servers' logs). The servers of a
deployment share the device: ``pdserve up`` gives each an equal share of it
(``--mem-fraction-static``).

For each deployment (colocated; 1P1D; 1P1D with EAGLE on decode; 1P1D with
EAGLE on prefill and decode), one after another on the same random-weight
checkpoint (Qwen3-0.6B's shape unless ``--smoke``) and a random EAGLE head:

1. greedy outputs of ``--num-requests`` prompts through the router, compared
   token for token with the colocated server's;
2. a bench.serving load (random prompts of mixed length, the long ones
   interfering with the others' decoding): TTFT mean / p99, TPOT mean, ITL p99,
   output tok/s, accept length;
3. a multi-turn load (bench.serving ``multiturn``): the second round's TTFT
   mean / p99 and TPOT mean.

Results are printed and, with ``--out``, written to gpu_pd_servers.json / .txt.
``--smoke`` shrinks everything so the script itself is checked on a CPU; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from pdserve.bench import serving
from pdserve.bench.gpu_report import Report, check_parser
from pdserve.up import Deployment, free_port
from pdserve.up import parse_args as up_args

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def deployments(draft: Path) -> list[tuple[str, list[str]]]:
    """(name, `pdserve up` flags); EAGLE with the default tree shape for the architecture."""
    eagle = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft)]
    return [("colocated", ["--disaggregation-mode", "null"]),
            ("1P1D", []),
            ("1P1D decode-EAGLE", eagle),
            ("1P1D prefill+decode-EAGLE", eagle + ["--speculative-prefill"])]


def prompts(n: int, seed: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def generate_all(url: str, inputs: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy outputs of every prompt, sent concurrently (16 at a time) through ``url``."""
    def one(ids: list[int]) -> list[int]:
        r = httpx.post(url + "/generate", timeout=600, json={
            "input_ids": ids, "sampling_params": dict(GREEDY, max_new_tokens=max_new_tokens)})
        r.raise_for_status()
        return r.json()["output_ids"]
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, inputs))


def serving_load(url: str, argv: list[str]) -> serving.Benchmark:
    bench = serving.Benchmark(serving.parse_args(["--base-url", url, "--backend", "pdserve", "--disable-tqdm",
                                                  *argv]))
    asyncio.run(serving._run_with_client(bench))
    return bench


def latency_row(m: serving.Metrics) -> dict[str, Any]:
    return {"completed": m.completed, "failed": m.failed, "ttft_mean_ms": round(m.mean_ttft_ms, 1),
            "ttft_p99_ms": round(m.p99_ttft_ms, 1), "tpot_mean_ms": round(m.mean_tpot_ms, 2),
            "itl_p99_ms": round(m.p99_itl_ms, 2), "output_tok_s": round(m.output_throughput, 1),
            "accept_length": None if m.accept_length is None else round(m.accept_length, 2)}


def check_load(name: str, load: str, m: serving.Metrics) -> None:
    """A load counts only when every request of it completed."""
    if m.failed or not m.completed:
        raise AssertionError(f"{name}: the {load} load had {m.failed} failed and {m.completed} completed requests")


def run_deployment(rep: Report, entry: dict[str, Any], name: str, flags: list[str], target: Path,
                   inputs: list[list[int]], reference: list[list[int]] | None, a: argparse.Namespace
                   ) -> list[list[int]]:
    port = free_port("127.0.0.1")
    # An explicit KV pool: its size is also that of each server's host staging copy
    # (Mooncake's non-CUDA build reaches host memory only). float32: the greedy
    # comparison with the colocated server must not hinge on bf16 near-ties.
    server_flags = ["--max-running-requests", "64", "--log-level", "warning", "--dtype", "float32",
                    "--max-total-tokens", str(a.max_total_tokens)]
    dep = Deployment(up_args(["--port", str(port), "--model-path", str(target), *flags, *server_flags]),
                     threading.Event())
    try:
        url = dep.start()
        outputs = generate_all(url, inputs, a.max_new_tokens)
        if reference is None and name != "colocated":
            rep.say(f"{name}: no colocated outputs to compare with (its section failed)")
        elif reference is not None:
            equal = sum(x == y for x, y in zip(outputs, reference))
            entry["greedy_equal_colocated"] = f"{equal}/{len(inputs)}"
            rep.say(f"{name}: greedy outputs equal to the colocated server's: {equal}/{len(inputs)}")
            if equal != len(inputs):
                raise AssertionError(f"{name}: outputs differ from the colocated server's")
        mixed = serving_load(url, ["--dataset-name", "random", "--num-prompts", str(a.num_prompts),
                                   "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
                                   "--random-range-ratio", "0.05", "--max-concurrency", "16",
                                   "--warmup-requests", "2"])
        assert mixed.rounds[-1].metrics is not None
        entry["mixed"] = latency_row(mixed.rounds[-1].metrics)
        rep.say(f"{name}: mixed lengths {entry['mixed']}")
        check_load(name, "mixed lengths", mixed.rounds[-1].metrics)
        turns = serving_load(url, ["--dataset-name", "multiturn", "--num-conversations", str(a.conversations),
                                   "--turns", "3", "--request-rate", "8", "--warmup-requests", "0"])
        second = turns.rounds[-1].metrics
        assert second is not None
        entry["multiturn_round2"] = latency_row(second)
        rep.say(f"{name}: multi-turn round 2 {entry['multiturn_round2']}")
        check_load(name, "multi-turn", second)
        return outputs
    finally:
        dep.stop()


def main(argv: list[str] | None = None) -> None:
    from pdserve.testing import build_random_draft, build_random_model

    ap = check_parser(__doc__ or "", "gpu_pd_servers")
    ap.add_argument("--only", default="", help="comma-separated deployment names to run (default: all)")
    ap.add_argument("--num-prompts", type=int, default=None, help="mixed-length load: requests (default 96)")
    ap.add_argument("--input-len", type=int, default=None, help="mixed-length load: input length (default 2048)")
    ap.add_argument("--output-len", type=int, default=None, help="mixed-length load: output length (default 128)")
    ap.add_argument("--conversations", type=int, default=None, help="multi-turn load: conversations (default 32)")
    a = ap.parse_args(argv)
    a.num_requests, a.max_new_tokens = (4, 8) if a.smoke else (64, 32)
    defaults = (6, 48, 8, 3) if a.smoke else (96, 2048, 128, 32)
    a.num_prompts, a.input_len, a.output_len, a.conversations = (
        given if given is not None else default for given, default in
        zip((a.num_prompts, a.input_len, a.output_len, a.conversations), defaults))
    # Room for 16 concurrent requests of the longest load, and the multi-turn history.
    a.max_total_tokens = 8192 if a.smoke else max(32768, 24 * (a.input_len + a.output_len))
    rep = Report(a.out, "gpu_pd_servers")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rep.say(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        if a.smoke:
            target = build_random_model(Path(tmp, "t"), "llama", num_layers=2, max_position_embeddings=4096)
        else:  # Qwen3-0.6B's layers; the character tokenizer's small vocabulary
            target = build_random_model(Path(tmp, "t"), "qwen3", hidden_size=1024, num_layers=28, num_heads=16,
                                        num_kv_heads=8, intermediate_size=3072, max_position_embeddings=8192)
        draft = build_random_draft(target, Path(tmp, "e"), "EAGLE")
        vocab = int(json.loads((target / "config.json").read_text())["vocab_size"])
        inputs = prompts(a.num_requests, 1, 16, 400 if not a.smoke else 40, vocab)
        only = set(filter(None, a.only.split(",")))
        reference: list[list[int]] | None = None
        for name, flags in deployments(draft):
            if only and name not in only and name != "colocated":
                continue
            with rep.section(name) as entry:
                outputs = run_deployment(rep, entry, name, flags, target, inputs, reference, a)
                if name == "colocated":
                    reference = outputs
    rep.conclude("all deployments ok")


if __name__ == "__main__":
    main()
