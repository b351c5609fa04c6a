"""Multi-turn traffic through 1P1D: decode-side prefix reuse on vs off, in one run.

    python -m pdserve.bench.multiturn_pd [--num-conversations 32] [--turns 3]
        [--request-rate 4] [--speculative-algorithm EAGLE] [--samples-n 4]

For each setting a fresh deployment (``pdserve up``'s: one prefill and one decode
server on the demo model unless ``--model-path``, the router in front) serves
bench.serving's ``multiturn`` load: a warm-up round, then a measured round whose
prompts extend the warm-up prompts with the answer and one more question. After
each round the servers' own counters are read (``/get_server_info``): KV bytes
decode received (``transfer_bytes``), prompt tokens decode served from its prefix
cache (``prefix_hit_tokens``), and the prompt tokens prefill computed. It prints,
per setting and round: requests, KV bytes per request, decode prefix hits per
request, mean / p99 TTFT. With ``--samples-n N`` it also sends every measured
prompt once more with ``n = N`` and reports the prompt tokens prefill computed per
request (the prompt is computed once for all samples, or once per sample).
"""

from __future__ import annotations

import argparse
import asyncio
import threading

import httpx

from pdserve.bench import serving
from pdserve.up import Deployment, free_port
from pdserve.up import parse_args as up_args


def counters(url: str) -> dict[str, float]:
    """The PD counters of one server's /get_server_info (0 where it has none)."""
    state = httpx.get(url + "/get_server_info", timeout=30).json().get("internal_state", {})
    pd = state.get("disaggregation") or {}
    return {"transfer_bytes": float(pd.get("transfer_bytes", 0)),
            "prefix_hit_tokens": float(pd.get("prefix_hit_tokens", 0)),
            "prefill_tokens_computed": float(state.get("prefill_tokens_computed", 0))}


class CountingBenchmark(serving.Benchmark):
    """bench.serving's benchmark, reading the servers' counters after every round."""

    def __init__(self, args: argparse.Namespace, prefill: str, decode: str) -> None:
        super().__init__(args)
        self.prefill, self.decode = prefill, decode
        self.last = (counters(prefill), counters(decode))
        self.deltas: list[tuple[dict[str, float], dict[str, float]]] = []

    def finish_round(self, rnd: serving.Round, accept_length: float | None) -> None:
        super().finish_round(rnd, accept_length)
        now = (counters(self.prefill), counters(self.decode))
        self.deltas.append(tuple({k: n[k] - o[k] for k in n} for n, o in zip(now, self.last)))  # type: ignore
        self.last = now


async def _n_samples(base_url: str, prompts: list[list[int]], n: int, output_len: int) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def one(ids: list[int]) -> None:
            r = await client.post("/generate", json={"input_ids": ids, "sampling_params": {
                "n": n, "temperature": 1.0, "seed": 1, "max_new_tokens": output_len}})
            r.raise_for_status()
        await asyncio.gather(*(one(ids) for ids in prompts))


def run_setting(name: str, a: argparse.Namespace, extra: list[str]) -> list[str]:
    port = free_port("127.0.0.1")
    flags = ["--port", str(port), "--log-level", "warning", *extra]
    if a.model_path:
        flags += ["--model-path", a.model_path]
    if a.speculative_algorithm:
        flags += ["--speculative-algorithm", a.speculative_algorithm]
    dep = Deployment(up_args(flags), threading.Event())
    lines = []
    try:
        url = dep.start()
        prefill = next(c.url for c in dep.children if c.name.startswith("prefill"))
        decode = next(c.url for c in dep.children if c.name.startswith("decode"))
        bench_args = serving.parse_args(["--base-url", url, "--backend", "pdserve", "--dataset-name", "multiturn",
                                         "--num-conversations", str(a.num_conversations), "--turns", str(a.turns),
                                         "--request-rate", str(a.request_rate), "--seed", str(a.seed),
                                         "--disable-tqdm", "--warmup-requests", "0"])
        bench = CountingBenchmark(bench_args, prefill, decode)
        asyncio.run(serving._run_with_client(bench))
        for rnd, (p, d) in zip(bench.rounds, bench.deltas):
            m = rnd.metrics
            assert m is not None
            reqs = max(1, m.completed)
            lines.append(f"{name:<22} {rnd.name.split(' (')[0]:<8} {m.completed:>4} {m.failed:>4} "
                         f"{d['transfer_bytes'] / reqs / 1024:>12.1f} {d['prefix_hit_tokens'] / reqs:>10.1f} "
                         f"{p['prefill_tokens_computed'] / reqs:>10.1f} {m.mean_ttft_ms:>10.1f} "
                         f"{m.p99_ttft_ms:>10.1f}")
        if a.samples_n > 1:
            prompts = [r.prompt_ids for r in bench.rounds[-1].requests if r.prompt_ids is not None]
            # A cold prefill cache: what the n samples' prompts cost by themselves.
            httpx.post(prefill + "/flush_cache", timeout=30).raise_for_status()
            before = counters(prefill)["prefill_tokens_computed"]
            asyncio.run(_n_samples(url, prompts, a.samples_n, 8))
            computed = counters(prefill)["prefill_tokens_computed"] - before
            lines.append(f"{name:<22} n={a.samples_n:<6} {len(prompts):>4}    - prefill computed "
                         f"{computed / max(1, len(prompts)):.1f} prompt tokens per request "
                         f"(prompts of {sum(map(len, prompts)) / max(1, len(prompts)):.1f} tokens)")
    finally:
        dep.stop()
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--speculative-algorithm", choices=("EAGLE", "EAGLE3"), default=None)
    ap.add_argument("--num-conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--samples-n", type=int, default=4, help="then every measured prompt with n = N (1: skip)")
    a = ap.parse_args(argv)
    rows = []
    for name, extra in (("reuse on", []), ("reuse off", ["--disable-decode-prefix-reuse"])):
        rows += run_setting(name, a, extra)
    print(f"1P1D, multiturn: {a.num_conversations} conversations, {a.turns} turns in the warm-up prompt, "
          f"{a.request_rate} req/s" + (f", decode {a.speculative_algorithm}" if a.speculative_algorithm else ""))
    print(f"{'setting':<22} {'round':<8} {'ok':>4} {'fail':>4} {'KV KiB/req':>12} {'hit tok/req':>10} "
          f"{'P tok/req':>10} {'TTFT mean':>10} {'TTFT p99':>10}")
    for line in rows:
        print(line)


if __name__ == "__main__":
    main()
