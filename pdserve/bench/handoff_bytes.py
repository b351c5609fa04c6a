"""What crosses the PD split per request, by kind, for each prefill x decode speculative
cell; and the same computed from the layouts at a real model's shape.

    python -m pdserve.bench.handoff_bytes --requests 16 --prompt-len 400

Measured: the demo model and its trained heads through an in-process prefill/decode pair
(the transfer managers and their byte counters, in-process copies instead of Mooncake):
bytes per request of target KV, draft KV, features and metadata as prefill sent them,
decode's draft prefill tokens per request, and the acceptance (tokens per verify round).
Computed: Llama-3.1-8B + its EAGLE3 head, bf16, 2,500-token prompts, at decode TP 1 and 2
(target and draft KV heads split over the decode ranks, features split too: each decode
rank receives its slice of every row and the ranks all-gather the rest; the draft state
record goes to every decode rank).
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from pdserve.disagg.protocol import TRANSFER_KINDS

# (prefill algorithm, decode algorithm, prefill head) per cell; "other" = EAGLE with
# another head than decode's (the feature path between two speculative sides).
CELLS = [(None, None), (None, "EAGLE"), (None, "EAGLE3"), ("EAGLE", "EAGLE"), ("EAGLE3", "EAGLE3"),
         ("other", "EAGLE")]


def measure(prompt_len: int, requests: int, new_tokens: int, tmp: str) -> list[dict[str, Any]]:
    from pdserve import assets
    from pdserve.disagg.decode_side import decode_scheduler
    from pdserve.disagg.local_pair import build_side, run_pair
    from pdserve.disagg.prefill_side import prefill_scheduler
    from pdserve.testing import build_random_draft

    demo = assets.path("demo")
    heads = {"EAGLE": str(assets.path("demo-eagle")), "EAGLE3": str(assets.path("demo-eagle3")),
             "other": str(build_random_draft(demo, f"{tmp}/other", "EAGLE", seed=5))}
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 150) for _ in range(prompt_len)] for _ in range(requests)]
    shape = {"speculative_num_steps": 2, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3}
    rows = []
    for p_algo, d_algo in CELLS:
        def spec(algo: str | None) -> dict[str, Any]:
            if algo is None:
                return {}
            return {"speculative_algorithm": "EAGLE" if algo == "other" else algo,
                    "speculative_draft_model_path": heads[algo], **shape}
        base = {"max_total_tokens": (prompt_len + new_tokens + 16) * requests + 64, "chunked_prefill_size": 512}
        p = build_side(prefill_scheduler, demo, {**base, **spec(p_algo)})
        d = build_side(decode_scheduler, demo, {**base, **spec(d_algo)},
                       fetch_ranks=lambda url, p=p: [p.mode.manager.rank_info(1, "127.0.0.1")])
        try:
            run_pair(p, d, prompts, {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
                     timeout=600)
            sent = p.mode.manager.bytes_by_kind
            rows.append({"cell": f"{p_algo or 'plain'} -> {d_algo or 'plain'}",
                         **{k: sent[k] / requests for k in TRANSFER_KINDS},
                         "draft_prefill": d.mode.draft_prefill_tokens / requests,
                         "accept": d.spec.avg_accept_length if d.spec is not None else None})
        finally:
            p.close()
            d.close()
    return rows


def computed(prompt_len: int = 2500) -> list[tuple[str, float, float, float, float]]:
    """Llama-3.1-8B (32 layers, 8 KV heads x 128) + EAGLE3 (1 layer, same heads, 3 x 4096
    features), bf16: MB per request of (target KV, draft KV, features, metadata)."""
    target = 32 * 2 * 8 * 128 * 2 * prompt_len
    draft = 1 * 2 * 8 * 128 * 2 * prompt_len
    features = 3 * 4096 * 2 * prompt_len
    state = 4 * (4096 * 4 // 3) + 512  # the DraftState record: base64 float32 hidden, top-k, JSON
    out = []
    for tp in (1, 2):
        out.append((f"draft state, decode TP{tp}", target, draft, 0, tp * state))
        out.append((f"features,    decode TP{tp}", target, 0, features, 0))
    return [(name, t / 1e6, d / 1e6, f / 1e6, m / 1e6) for name, t, d, f, m in out]


def main(argv: list[str] | None = None) -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args.prompt_len, args.requests, args.new_tokens, tmp)
    print(f"demo model, {args.requests} requests of {args.prompt_len} prompt tokens; bytes per request as "
          "prefill sent them")
    print(f"{'cell':>18} {'target KV':>10} {'draft KV':>9} {'features':>9} {'metadata':>9} {'total/target':>12} "
          f"{'decode draft prefill tok':>24} {'accept':>7}")
    for r in rows:
        total = sum(r[k] for k in TRANSFER_KINDS)
        accept = f"{r['accept']:.2f}" if r["accept"] else "-"
        print(f"{r['cell']:>18} {r['target_kv']:>10.0f} {r['draft_kv']:>9.0f} {r['features']:>9.0f} "
              f"{r['metadata']:>9.0f} {total / r['target_kv']:>12.3f} {r['draft_prefill']:>24.0f} {accept:>7}")
    print("\nLlama-3.1-8B + EAGLE3, bf16, 2,500-token prompt, computed from the layouts (MB per request)")
    print(f"{'scheme':>26} {'target KV':>10} {'draft KV':>9} {'features':>9} {'metadata':>9} {'total/target':>12}")
    for name, t, d, f, m in computed():
        print(f"{name:>26} {t:>10.2f} {d:>9.2f} {f:>9.2f} {m:>9.3f} {(t + d + f + m) / t:>12.3f}")


if __name__ == "__main__":
    main()
