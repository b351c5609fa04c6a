"""FP8 vs default KV cache: pool capacity in tokens and wire bytes per request.

    python -m pdserve.bench.kv_cache_dtype --kv-dtypes auto fp8_e4m3 fp8_e5m2 --dtype bfloat16

Part 1, capacity: the tokens the KV pool gets from the same memory budget
(``--cpu-kv-budget-gb``, no ``--max-total-tokens``: what ``size_kv_pages`` gives a
server), per ``--kv-cache-dtype``, on the demo model; plus the bytes per token at a
Llama-3.1-8B shape (32 layers, 8 KV heads of 128), computed, not run.

Part 2, wire bytes: held-out demo questions through an in-process prefill/decode pair
(``disagg.local_pair``: real control sockets, in-process copies); bytes the prefill side
sent per request, by kind (target KV; with a speculative decode behind a plain prefill the
target features, which stay in the model dtype; behind a prefill running the same draft,
the draft's KV, in the KV dtype; the handoff metadata), and whether the greedy outputs equal the colocated engine's with the
same KV dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pdserve import assets
from pdserve.assets import demo_tasks
from pdserve.config import ServerArgs
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.memory import TokenToKVPool
from pdserve.scheduler.memory_budget import size_kv_pages
from pdserve.tokenizer import load_tokenizer

LLAMA8B = (32, 8, 128)  # layers, KV heads, head dim


def capacity(model: Path, kv: str, dtype: str, budget_gb: float) -> dict[str, Any]:
    args = ServerArgs(model_path=str(model), dtype=dtype, kv_cache_dtype=kv, cpu_kv_budget_gb=budget_gb,
                      max_running_requests=4096)
    runner = ModelRunner(args, model, TPGroup())
    cfg = runner.config
    pages = size_kv_pages(args, runner, TPGroup()) - 1  # the padding page is no capacity
    per_token = TokenToKVPool.bytes_per_token(cfg.num_layers, runner.num_local_kv_heads, cfg.head_dim,
                                              runner.kv_dtype)
    big = TokenToKVPool.bytes_per_token(*LLAMA8B, runner.kv_dtype)
    return {"kv": kv, "kv_dtype": str(runner.kv_dtype).replace("torch.", ""), "bytes_per_token": per_token,
            "pool_tokens": pages * args.page_size, "llama8b_bytes_per_token": big,
            "llama8b_tokens_per_gib": (1 << 30) // big}


def wire(model: Path, kv: str, dtype: str, p_algo: str | None, d_algo: str | None, questions: int
         ) -> dict[str, Any]:
    from pdserve import Engine
    from pdserve.disagg.decode_side import decode_scheduler
    from pdserve.disagg.local_pair import build_side, run_pair
    from pdserve.disagg.prefill_side import prefill_scheduler

    tok = load_tokenizer(model)
    convs = [c for t in (*demo_tasks.TASKS, "multi-turn") for c in demo_tasks.heldout_conversations(t, questions, 0)]
    ids = [tok(tok.apply_chat_template(list(c.messages), add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for c in convs]
    params = {"max_new_tokens": 40, "temperature": 0}
    base = {"dtype": dtype, "kv_cache_dtype": kv, "max_total_tokens": 65536, "page_size": 16}
    def spec(algo: str | None) -> dict[str, Any]:
        return {} if algo is None else {
            "speculative_algorithm": algo, "speculative_draft_model_path": str(assets.path("demo-eagle")),
            "speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
    with Engine(model_path=str(model), **base) as engine:
        ref = [r["output_ids"] for r in engine.generate(input_ids=ids, sampling_params=params)]
    p = build_side(prefill_scheduler, model, {**base, **spec(p_algo)})
    d = build_side(decode_scheduler, model, {**base, **spec(d_algo)},
                   fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        got = [r.output_ids for r in run_pair(p, d, ids, params, timeout=600)]
        by_kind = dict(p.mode.manager.bytes_by_kind)
    finally:
        p.close()
        d.close()
    prompt_tokens = sum(len(i) for i in ids)
    sent = sum(by_kind.values())
    return {"kv": kv, "prefill": p_algo or "plain", "decode": d_algo or "plain", "requests": len(ids), "prompt_tokens": prompt_tokens,
            "bytes_by_kind": by_kind, "bytes_per_request": sent / len(ids),
            "kv_bytes_per_prompt_token": by_kind["target_kv"] / prompt_tokens, "outputs_equal_colocated": got == ref}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: the embedded demo model")
    ap.add_argument("--kv-dtypes", nargs="+", default=["auto", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--dtype", default="bfloat16", help="the model dtype (auto KV = this)")
    ap.add_argument("--budget-gb", type=float, default=1.0, help="--cpu-kv-budget-gb of part 1")
    ap.add_argument("--questions", type=int, default=16, help="held-out questions per task in part 2")
    ap.add_argument("--output-file", type=Path, default=None)
    a = ap.parse_args(argv)
    model = a.model or assets.path("demo")
    caps = [capacity(model, kv, a.dtype, a.budget_gb) for kv in a.kv_dtypes]
    ref = caps[0]
    print(f"Part 1: KV pool capacity from --cpu-kv-budget-gb {a.budget_gb} (x 0.85), model dtype {a.dtype}")
    print("| --kv-cache-dtype | stored as | bytes/token (demo) | pool tokens | vs first "
          "| bytes/token (Llama-3.1-8B shape) |")
    print("|---|---|---|---|---|---|")
    for c in caps:
        print(f"| {c['kv']} | {c['kv_dtype']} | {c['bytes_per_token']} | {c['pool_tokens']} | "
              f"{c['pool_tokens'] / ref['pool_tokens']:.2f}x | {c['llama8b_bytes_per_token']} |")
    cells = ((None, None), (None, "EAGLE"), ("EAGLE", "EAGLE"))  # the last: prefill sends its draft's KV
    wires = [wire(model, kv, a.dtype, pa, da, a.questions) for kv in a.kv_dtypes for pa, da in cells]
    print(f"\nPart 2: bytes written by prefill per request, 1P1D in one process, {wires[0]['requests']} requests "
          f"({wires[0]['prompt_tokens']} prompt tokens)")
    print("| --kv-cache-dtype | prefill -> decode | bytes/request (all) | target KV | draft KV | features | metadata "
          "| target KV bytes/prompt token | greedy = colocated (same KV dtype) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in wires:
        n, kind = w["requests"], w["bytes_by_kind"]
        print(f"| {w['kv']} | {w['prefill']} -> {w['decode']} | {w['bytes_per_request']:.0f} | "
              f"{kind['target_kv'] / n:.0f} | {kind['draft_kv'] / n:.0f} | {kind['features'] / n:.0f} | "
              f"{kind['metadata'] / n:.0f} | {w['kv_bytes_per_prompt_token']:.1f} | "
              f"{'yes' if w['outputs_equal_colocated'] else 'NO'} |")
    if a.output_file:
        a.output_file.write_text(json.dumps({"capacity": caps, "wire": wires}, indent=1))
    if not all(w["outputs_equal_colocated"] for w in wires):
        sys.exit(1)


if __name__ == "__main__":
    main()
