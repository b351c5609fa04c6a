"""The GPU checks of the CUDA engine (steps kernels, graphs and speed of scripts/gpu_proof.sh; issue 33).

Sections (each runs even when an earlier one failed; every result is printed and,
with --out, written to gpu_check.json and gpu_check.txt):

1. kernels: the triton backend's decode and extend kernels against a float32
   reference in bf16 at Llama-3-8B attention shapes (32 query / 8 KV heads, head
   dim 128, contexts up to 8k, batch up to 256), with their time per call;
2. sync: steady decode steps of an engine under
   ``torch.cuda.set_sync_debug_mode("error")``, the one allowed read (the sampled
   tokens, ``device_io.fetch``) excepted;
3. graphs: CUDA-graph decode gives the eager engine's greedy tokens;
4. speed, on random weights at real shapes (Qwen3-0.6B, Llama-3.1-8B, bf16):
   batch-1 decode time per token against the HBM roofline (weight + KV bytes
   per step / the bandwidth of a device-to-device copy measured in the same run),
   prefill tokens/s against a bf16 matmul's measured TFLOP/s, and the offline
   throughput of 256 requests with input and output lengths uniform in 100-1024
   (mini-sglang's published workload), graphs on and off.

``--smoke`` shrinks every shape so the script itself can be checked on a CPU
(under TRITON_INTERPRET=1); its numbers mean nothing.
"""

# Layout: this module is sections 2-4 (engines on random weights) and the CLI; section 1
# is gpu_kernels.py's, the report and options every GPU check shares gpu_report.py's.
# Their public names are importable from here as before.

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.gpu_kernels import REL_TOL, check_kernels, reference_attention, relative_error, tree_ancestry
from pdserve.bench.gpu_report import Report, check_parser, timed

__all__ = ["MODELS", "REL_TOL", "SECTIONS", "SMOKE_MODEL", "Report", "check_kernels", "check_parser", "main",
           "reference_attention", "relative_error", "timed", "tree_ancestry", "write_config"]

MODELS = {
    # name: (architecture, hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, tied)
    "qwen3-0.6b": ("qwen3", 1024, 3072, 28, 16, 8, 128, 151936, True),
    "llama-3.1-8b": ("llama", 4096, 14336, 32, 32, 8, 128, 128256, False),
}
SMOKE_MODEL = ("llama", 64, 128, 2, 4, 2, 32, 128, False)


def write_config(out: Path, spec: tuple) -> Path:
    """A Hugging Face config.json for random weights (--load-format dummy)."""
    arch, hidden, inter, layers, heads, kv_heads, head_dim, vocab, tied = spec
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"],
        "model_type": arch, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "tie_word_embeddings": tied, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0 if arch == "qwen3" else 500000.0,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def param_bytes(spec: tuple) -> int:
    arch, hidden, inter, layers, heads, kv_heads, head_dim, vocab, tied = spec
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    return 2 * (layers * per_layer + vocab * hidden * (1 if tied else 2))


# ---- engines on random weights -----------------------------------------------------------

def make_engine(model_dir: Path, tokenizer: Path, device: torch.device, **kwargs: Any) -> Any:
    from pdserve import Engine

    base: dict[str, Any] = dict(model_path=str(model_dir), tokenizer_path=str(tokenizer), load_format="dummy",
                                device=device.type, attention_backend="triton")
    if device.type == "cpu":
        base.update(max_total_tokens=4096)
    base.update(kwargs)
    return Engine(**base)


def greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}


def check_sync(rep: Report, entry: dict[str, Any], model_dir: Path, tokenizer: Path, device: torch.device) -> None:
    from pdserve.model import device_io
    from pdserve.scheduler.req import samples_from_message

    engine = make_engine(model_dir, tokenizer, device)
    try:
        sched = engine._scheduler
        b = engine.builder
        prompts = [[random.Random(i).randrange(3, 100) for _ in range(20 + 7 * i)] for i in range(4)]
        params = [greedy(64), dict(temperature=0.8, top_p=0.9, top_k=40, seed=3, max_new_tokens=64, ignore_eos=True),
                  dict(temperature=1.0, frequency_penalty=0.3, min_new_tokens=40, max_new_tokens=64), greedy(64)]
        messages = b.build(prompts, b.sampling_params(params, 4), True, 2)
        for m in messages:
            sched.add(samples_from_message(m)[0])
        while sched.waiting or sched.chunked is not None:
            sched.step()
        real_fetch = device_io.fetch

        def fetch(x: torch.Tensor) -> list:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            try:
                return real_fetch(x)
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("error")
        device_io.fetch = fetch
        steps = 0
        try:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            for _ in range(16):
                out = sched.step()
                if out.finished:
                    raise AssertionError(f"a decode step failed or finished requests: "
                                         f"{[r.finish for r in out.finished]}")
                steps += 1
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            device_io.fetch = real_fetch
        for m in messages:
            sched.abort(m.rid)
        sched.step()
        entry["steady_decode_steps_without_sync"] = steps
        rep.say(f"{steps} decode steps of 4 rows ran under sync debug mode 'error' (one fetch each)")
    finally:
        engine.shutdown()


def check_graphs(rep: Report, entry: dict[str, Any], model_dir: Path, tokenizer: Path, device: torch.device) -> None:
    if device.type != "cuda":
        entry["graphs"] = "skipped: no CUDA device"
        rep.say("graph capture needs a CUDA device: skipped")
        return
    prompts = [[random.Random(i).randrange(3, 100) for _ in range(10 + 13 * i)] for i in range(5)]
    outs: dict[str, list[list[int]]] = {}
    # float32: a padded graph batch changes the GEMMs' shapes, which in bf16 can flip a
    # near-tied greedy token without anything being wrong.
    for name, kwargs in (("eager", {"dtype": "float32"}),
                         ("graphs", {"dtype": "float32", "enable_cuda_graph": True, "cuda_graph_max_bs": 8})):
        engine = make_engine(model_dir, tokenizer, device, **kwargs)
        try:
            res = engine.generate(input_ids=prompts, sampling_params=greedy(48))
            outs[name] = [r["output_ids"] for r in res]
        finally:
            engine.shutdown()
    same = outs["eager"] == outs["graphs"]
    entry["graph_tokens_equal_eager"] = same
    entry["ok"] = same
    rep.say(f"graph replay tokens == eager tokens: {same}")


# ---- 4. speed -------------------------------------------------------------------------------

def device_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy, read + write counted."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    secs = timed(lambda: dst.copy_(src), device, repeat=10)
    return 2 * n / secs


def matmul_flops(device: torch.device) -> float:
    n = 8192 if device.type == "cuda" else 256
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    secs = timed(lambda: a @ b, device, repeat=10)
    return 2 * n ** 3 / secs


def check_speed(rep: Report, entry: dict[str, Any], name: str, spec: tuple, model_dir: Path, tokenizer: Path,
                device: torch.device, smoke: bool, bandwidth: float, flops: float, graph_modes: tuple[bool, ...],
                offline_requests: int) -> None:
    arch, hidden, inter, layers, heads, kv_heads, head_dim, vocab, tied = spec
    weights = param_bytes(spec)
    kv_per_token = 2 * layers * kv_heads * head_dim * 2
    short, long_ = (4, 12) if smoke else (128, 640)
    prompt_len = 16 if smoke else 512
    for graphs in graph_modes:
        tag = "graphs" if graphs else "eager"
        kwargs = {"enable_cuda_graph": True} if graphs else {}
        engine = make_engine(model_dir, tokenizer, device, **kwargs)
        try:
            prompt = [[random.Random(7).randrange(3, vocab) for _ in range(prompt_len)]]

            def run(n: int) -> float:
                t0 = time.perf_counter()
                engine.generate(input_ids=prompt, sampling_params=greedy(n))
                return time.perf_counter() - t0
            run(short)  # warm-up (kernel compilation, allocations)
            per_token = (run(long_) - run(short)) / (long_ - short)
            avg_ctx = prompt_len + (short + long_) / 2
            roofline = (weights + kv_per_token * avg_ctx) / bandwidth
            entry[f"decode_b1_{tag}"] = {"ms_per_token": per_token * 1e3, "roofline_ms": roofline * 1e3,
                                         "fraction_of_roofline": roofline / per_token}
            rep.say(f"{name} batch-1 decode ({tag}): {per_token * 1e3:.2f} ms/token, roofline "
                    f"{roofline * 1e3:.2f} ms ({roofline / per_token:.2f}x of it)")
            if not graphs:
                n_prompts, plen = (2, 32) if smoke else (16, 2048)
                prompts = [[random.Random(i).randrange(3, vocab) for _ in range(plen)] for i in range(n_prompts)]
                engine.generate(input_ids=prompts[:1], sampling_params=greedy(1))
                t0 = time.perf_counter()
                engine.generate(input_ids=prompts, sampling_params=greedy(1))
                secs = time.perf_counter() - t0
                tokens = n_prompts * plen
                flop_per_token = 2 * weights / 2 + 4 * layers * heads * head_dim * plen / 2
                rate = tokens / secs
                frac = rate * flop_per_token / flops
                entry["prefill"] = {"tokens_per_s": rate, "fraction_of_matmul_rate": frac}
                rep.say(f"{name} prefill {n_prompts} x {plen}: {rate:,.0f} tokens/s, {frac:.2f}x of the matmul rate")
            n_req, lo, hi = (min(offline_requests, 4), 2, 6) if smoke else (offline_requests, 100, 1024)
            rng = random.Random(0)
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n_req)]
            outs = [rng.randint(lo, hi) for _ in range(n_req)]
            t0 = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params=[greedy(n) for n in outs])
            secs = time.perf_counter() - t0
            entry[f"offline_{tag}"] = {"seconds": secs, "output_tokens_per_s": sum(outs) / secs,
                                       "total_tokens_per_s": (sum(outs) + sum(map(len, prompts))) / secs}
            rep.say(f"{name} offline {n_req} requests ({tag}): {secs:.1f} s, {sum(outs) / secs:,.0f} output "
                    f"tokens/s")
        finally:
            engine.shutdown()


SECTIONS = ("kernels", "sync", "graphs", "speed")


def main(argv: list[str] | None = None) -> None:
    ap = check_parser(__doc__ or "", "gpu_check")
    ap.add_argument("--models", default="qwen3-0.6b,llama-3.1-8b")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections to run "
                    f"({','.join(SECTIONS)})")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip")
    ap.add_argument("--speed-graphs", choices=("off", "on", "both"), default="both",
                    help="speed: eager, CUDA graphs, or both one after the other (graphs need CUDA)")
    ap.add_argument("--offline-requests", type=int, default=256,
                    help="speed: requests of the offline throughput run (input/output lengths 100-1024)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chosen = set(filter(None, args.only.split(","))) - set(filter(None, args.skip.split(",")))
    unknown = chosen - set(SECTIONS)
    if unknown:
        ap.error(f"--only / --skip: unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    graph_modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.speed_graphs]
    if device.type != "cuda":
        graph_modes = tuple(g for g in graph_modes if not g)
    rep = Report(args.out)
    rep.say(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch "
            f"{torch.__version__}")
    from pdserve import assets

    tokenizer = Path(assets.path("demo"))
    with tempfile.TemporaryDirectory() as tmp:
        small = write_config(Path(tmp, "small"), SMOKE_MODEL if args.smoke else
                             ("llama", 1024, 2048, 4, 8, 2, 128, 32000, False))
        if "kernels" in chosen:
            with rep.section("kernels") as entry:
                check_kernels(rep, entry, device, args.smoke)
        if "sync" in chosen:
            with rep.section("sync") as entry:
                check_sync(rep, entry, small, tokenizer, device)
        if "graphs" in chosen:
            with rep.section("graphs") as entry:
                check_graphs(rep, entry, small, tokenizer, device)
        if "speed" in chosen:
            bandwidth, flops = device_bandwidth(device), matmul_flops(device)
            rep.results["device"] = {"copy_bandwidth_GBps": bandwidth / 1e9, "matmul_TFLOPs": flops / 1e12}
            rep.say(f"device-to-device copy: {bandwidth / 1e9:,.0f} GB/s; bf16 matmul: {flops / 1e12:,.0f} TFLOP/s")
            if not graph_modes:
                rep.results["speed"] = {"skipped": "CUDA graphs need a CUDA device"}
                rep.say("speed with CUDA graphs needs a CUDA device: skipped")
            for name in filter(None, args.models.split(",") if graph_modes else []):
                spec = SMOKE_MODEL if args.smoke else MODELS[name]
                model_dir = write_config(Path(tmp, name), spec)
                with rep.section(f"speed {name}") as entry:
                    check_speed(rep, entry, name, spec, model_dir, tokenizer, device, args.smoke, bandwidth, flops,
                                graph_modes, args.offline_requests)
    rep.conclude()


if __name__ == "__main__":
    main()
