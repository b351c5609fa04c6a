"""The GPU proof of disaggregation and EAGLE on the device, in-process part
(the pd step of scripts/gpu_proof.sh; issue 23).

Sections (each runs even when an earlier one failed; results printed and, with
--out, written to gpu_check_pd.json / .txt):

1. pd: a prefill and a decode scheduler in one process on the device, over
   ``LocalTransfer`` (cudaMemcpy on a GPU), for every staging mode pair
   (direct/direct, host/host, host/direct) and decode plain or with a random EAGLE
   head: greedy outputs equal the colocated engine's, and a second turn that hits
   decode's prefix cache too;
2. spec: chain (top-k 1) and tree EAGLE greedy outputs equal plain decoding on the
   device, with their acceptance;
3. transfer: KV bytes moved through the host staging path (stage out, copy between
   twins, stage in) against a plain device -> host -> device copy of the same bytes,
   in GB/s.

Needs no Mooncake (the two-server 1P1D proof is separate). ``--smoke`` shrinks
everything so the script itself is checked on a CPU; its numbers mean nothing.
"""

from __future__ import annotations

import random
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.gpu_report import Report, check_parser

# Equality checks run in float32: a different batch composition (prefill and decode
# batch apart from each other) changes the GEMMs' shapes, which in bf16 can flip a
# near-tied greedy token without anything being wrong.
EXACT = {"dtype": "float32"}


def _prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 90) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def check_pd(rep: Report, entry: dict[str, Any], target: Path, draft: Path, device: torch.device, n: int,
             pair_timeout: float = 60) -> None:
    from pdserve import Engine
    from pdserve.disagg.local_pair import build_side, run_pair
    from pdserve.disagg.decode_side import decode_scheduler
    from pdserve.disagg.prefill_side import prefill_scheduler

    greedy = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    base = {**EXACT, "device": device.type, "max_total_tokens": 16384, "max_running_requests": 128}
    turn1 = _prompts(n, 1, 16, 200)
    with Engine(model_path=str(target), **base) as engine:
        answers = [r["output_ids"] for r in engine.generate(input_ids=turn1, sampling_params=greedy)]
        turn2 = [p + a + [7, 8, 9] for p, a in zip(turn1, answers)]
        ref2 = [r["output_ids"] for r in engine.generate(input_ids=turn2, sampling_params=greedy)]
    eagle = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft), speculative_num_steps=3,
                 speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    cells = [("direct", "direct", False), ("host", "host", False), ("host", "direct", True),
             ("direct", "direct", True)]
    failed: list[str] = []
    for p_mode, d_mode, spec in cells:  # every cell reports, whatever failed before it
        name = f"P {p_mode} / D {d_mode}{' EAGLE' if spec else ''}"
        p = d = None
        try:
            p = build_side(prefill_scheduler, target, {**base, "disaggregation_kv_staging": p_mode})
            d = build_side(decode_scheduler, target,
                           {**base, "disaggregation_kv_staging": d_mode, **(eagle if spec else {})},
                           fetch_ranks=lambda url, p=p: [p.mode.manager.rank_info(1, "127.0.0.1")])
            t0 = time.perf_counter()
            out1 = [r.output_ids for r in run_pair(p, d, turn1, greedy, timeout=pair_timeout)]
            out2 = [r.output_ids for r in run_pair(p, d, turn2, greedy, timeout=pair_timeout)]
            same1 = sum(a == b for a, b in zip(out1, answers))
            same2 = sum(a == b for a, b in zip(out2, ref2))
            entry[name] = {"turn1_equal": same1, "turn2_equal": same2, "requests": n,
                           "decode_prefix_hit_tokens": d.mode.prefix_hit_tokens,
                           "seconds": round(time.perf_counter() - t0, 2), "ok": same1 == n and same2 == n}
            rep.say(f"{name}: greedy equal to colocated {same1}/{n}, second turn {same2}/{n} "
                    f"(decode prefix hits {d.mode.prefix_hit_tokens} tokens)")
            if same1 != n or same2 != n:
                failed.append(name)
        except Exception as exc:
            entry[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            rep.say(f"{name}: FAILED: {traceback.format_exc()}")
            failed.append(name)
        finally:
            for side in (p, d):
                if side is not None:
                    side.close()
                    side.release()  # its device memory back now, for the next cell's pair
            p = d = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if failed:
        raise AssertionError(f"cells failed or differ from the colocated engine: {'; '.join(failed)}")


def check_spec(rep: Report, entry: dict[str, Any], target: Path, draft: Path, device: torch.device, n: int) -> None:
    from pdserve import Engine

    greedy = {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True}
    prompts = _prompts(n, 2, 8, 120)
    base = {**EXACT, "device": device.type, "max_total_tokens": 16384}
    with Engine(model_path=str(target), **base) as engine:
        plain = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=greedy)]
    # On a GPU each shape runs twice: eagerly, then with decode and draft-tree CUDA graphs
    # (the same trees: equal acceptance), timed in the same run after a warm-up.
    variants = [("", {})] + ([(" graphs", {"enable_cuda_graph": True})] if device.type == "cuda" else [])
    for name, shape in (("chain", (4, 1, 5)), ("tree", (3, 2, 6))):
        for suffix, extra in variants:
            with Engine(model_path=str(target), **base, **extra, speculative_algorithm="EAGLE",
                        speculative_draft_model_path=str(draft), speculative_num_steps=shape[0],
                        speculative_eagle_topk=shape[1], speculative_num_draft_tokens=shape[2]) as engine:
                engine.generate(input_ids=prompts[:2], sampling_params=greedy)  # warm-up
                spec = engine._scheduler.spec
                before = spec.num_verify_rounds, spec.num_emitted_tokens
                start = time.perf_counter()
                outs = engine.generate(input_ids=prompts, sampling_params=greedy)
                seconds = time.perf_counter() - start
                accept = (spec.num_emitted_tokens - before[1]) / max(1, spec.num_verify_rounds - before[0])
                del spec  # it holds the runner: the next engine must find the device free
            same = sum(o["output_ids"] == ref for o, ref in zip(outs, plain))
            tokens = sum(len(o["output_ids"]) for o in outs)
            entry[name + suffix] = {"equal": same, "requests": n, "accept_length": round(accept, 3),
                                    "output_tok_s": round(tokens / seconds, 1)}
            rep.say(f"EAGLE {name}{suffix} {shape}: greedy equal to plain {same}/{n}, accept length {accept:.2f}, "
                    f"{tokens / seconds:,.0f} output tok/s")
            if same != n:
                raise AssertionError(f"EAGLE {name}{suffix}: outputs differ from plain decoding")


def check_transfer(rep: Report, entry: dict[str, Any], device: torch.device, smoke: bool) -> None:
    from pdserve.disagg.staging import HostStaging
    from pdserve.disagg.transfer import LocalTransfer, coalesce

    # Llama-3-8B-like KV per token: 32 layers x K/V x 8 heads x 128 x bf16 = 128 KiB.
    layers, slots, width = (2, 4096, 256) if smoke else (32, 16384, 8 * 128)
    dtype = torch.float32 if smoke else torch.bfloat16
    src = [torch.randn(slots, width, dtype=dtype, device=device) for _ in range(2 * layers)]
    dst = [torch.zeros_like(t) for t in src]
    out, into = HostStaging(), HostStaging()
    src_twins = [out.twin(f"b{i}", t) for i, t in enumerate(src)]
    dst_twins = [into.twin(f"b{i}", t) for i, t in enumerate(dst)]
    moved = list(range(1, slots // 2))  # half the pool, contiguous: one write per buffer
    engine = LocalTransfer()
    row = width * src[0].element_size()
    nbytes = len(moved) * row * len(src)

    def staged() -> None:
        out.stage_out(moved)
        for s, d in zip(src_twins, dst_twins):
            engine.write("local", coalesce([s.data_ptr() + i * row for i in moved],
                                            [d.data_ptr() + i * row for i in moved], row))
        into.stage_in(moved)

    def plain() -> None:
        for s, d in zip(src, dst):
            d[1: slots // 2].copy_(s[1: slots // 2].to("cpu").to(device))

    for name, fn in (("staged", staged), ("plain d2h2d", plain)):
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        gbps = nbytes / (time.perf_counter() - t0) / 1e9
        entry[name] = round(gbps, 2)
        rep.say(f"{name}: {nbytes / 2**20:,.0f} MiB at {gbps:,.2f} GB/s")
    delivered = all(torch.equal(a[1: slots // 2], b[1: slots // 2]) for a, b in zip(src, dst))
    out.close()
    into.close()
    if not delivered:
        raise AssertionError("the staged copy did not deliver the bytes")


def main(argv: list[str] | None = None) -> None:
    from pdserve.testing import build_random_draft, build_random_model

    ap = check_parser(__doc__ or "", "gpu_check_pd")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip (pd,spec,transfer)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    skip = set(filter(None, args.skip.split(",")))
    rep = Report(args.out, "gpu_check_pd")
    rep.say(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch "
            f"{torch.__version__}")
    n = 4 if args.smoke else 64
    with tempfile.TemporaryDirectory() as tmp:
        size = dict(hidden_size=64, num_layers=2) if args.smoke else dict(hidden_size=512, num_layers=8)
        target = build_random_model(Path(tmp, "t"), "llama", num_heads=8, num_kv_heads=2,
                                    intermediate_size=4 * size["hidden_size"], **size)
        draft = build_random_draft(target, Path(tmp, "e"), "EAGLE")
        if "pd" not in skip:
            with rep.section("pd") as entry:
                check_pd(rep, entry, target, draft, device, n)
        if "spec" not in skip:
            with rep.section("spec") as entry:
                check_spec(rep, entry, target, draft, device, n)
        if "transfer" not in skip:
            with rep.section("transfer") as entry:
                check_transfer(rep, entry, device, args.smoke)
    rep.conclude()


if __name__ == "__main__":
    main()
