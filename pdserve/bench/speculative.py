"""Speculative decoding on the demo model: accept length and output tokens/s, with
and without EAGLE / EAGLE3, at several batch sizes, in one run (offline engine).

    python -m pdserve.bench.speculative --batch-sizes 1 8 32 --shapes 3,1,4 5,4,8

Prompts are held-out demo questions (all three tasks, chat template); every
configuration answers the same prompts greedily, and the outputs are checked
to equal the plain engine's token for token.  Accept length = tokens emitted
per verify round (accepted drafts + the bonus token), SGLang's convention.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Row:
    config: str
    batch: int
    output_tokens: int
    seconds: float
    accept_length: float | None
    same_as_plain: bool

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def demo_prompts(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    from pdserve.assets import demo_tasks

    per_task = [demo_tasks.heldout_conversations(task, n, seed) for task in demo_tasks.TASKS]
    convs = [c for trio in zip(*per_task) for c in trio][:n]  # the tasks interleaved
    out = []
    for c in convs:
        text = tokenizer.apply_chat_template(list(c.messages), add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def run_config(name: str, engine_kwargs: dict[str, Any], prompts: list[list[int]], batch_sizes: list[int],
               params: dict[str, Any], reference: dict[int, list[list[int]]] | None
               ) -> tuple[list[Row], dict[int, list[list[int]]]]:
    """Rows for one engine configuration, and its outputs per batch size."""
    from pdserve import Engine

    rows, outputs = [], {}
    with Engine(**engine_kwargs) as engine:
        engine.generate(input_ids=prompts[:2], sampling_params=params)  # warm-up
        spec = engine._scheduler.spec
        for b in batch_sizes:
            rounds0 = spec.num_verify_rounds if spec else 0
            emitted0 = spec.num_emitted_tokens if spec else 0
            outs: list[list[int]] = []
            t0 = time.perf_counter()
            for i in range(0, len(prompts), b):
                res = engine.generate(input_ids=prompts[i: i + b], sampling_params=params)
                outs += [r["output_ids"] for r in res]
            dt = time.perf_counter() - t0
            engine.flush_cache()
            accept = None
            if spec is not None:
                accept = (spec.num_emitted_tokens - emitted0) / max(1, spec.num_verify_rounds - rounds0)
            same = reference is None or reference[b] == outs
            rows.append(Row(name, b, sum(len(o) for o in outs), dt, accept, same))
            outputs[b] = outs
            print(f"{name:18s} batch {b:3d}: {rows[-1].tokens_per_s:8.1f} tok/s"
                  + (f", accept length {accept:.2f}" if accept is not None else ""), file=sys.stderr, flush=True)
    return rows, outputs


def main(argv: list[str] | None = None) -> None:
    from pdserve import assets

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="target (default: the embedded demo model)")
    ap.add_argument("--eagle", default=None, help="EAGLE head (default: the demo's)")
    ap.add_argument("--eagle3", default=None, help="EAGLE3 head (default: the demo's)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--shapes", nargs="+", default=["3,1,4", "5,4,8"],
                    help="speculative (num_steps,eagle_topk,num_draft_tokens) settings")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model_path or str(assets.path("demo"))
    heads = {"EAGLE": args.eagle or str(assets.path("demo-eagle")),
             "EAGLE3": args.eagle3 or str(assets.path("demo-eagle3"))}
    from transformers import AutoTokenizer

    prompts = demo_prompts(AutoTokenizer.from_pretrained(model), args.num_prompts, args.seed)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    common = {"model_path": model, "max_total_tokens": 65536}
    rows, reference = run_config("plain", common, prompts, args.batch_sizes, params, None)
    for algo, head in heads.items():
        for shape in args.shapes:
            s, k, n = (int(x) for x in shape.split(","))
            kw = dict(common, speculative_algorithm=algo, speculative_draft_model_path=head,
                      speculative_num_steps=s, speculative_eagle_topk=k, speculative_num_draft_tokens=n)
            rows += run_config(f"{algo} ({s},{k},{n})", kw, prompts, args.batch_sizes, params, reference)[0]
    plain = {r.batch: r.tokens_per_s for r in rows if r.config == "plain"}
    print(f"\n{len(prompts)} held-out demo prompts, at most {args.max_new_tokens} greedy tokens each, "
          f"{torch.get_num_threads()} torch threads\n")
    print("| config | batch | output tok/s | vs plain | accept length | outputs equal plain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        acc = f"{r.accept_length:.2f}" if r.accept_length is not None else "-"
        print(f"| {r.config} | {r.batch} | {r.tokens_per_s:.1f} | {r.tokens_per_s / plain[r.batch]:.2f}x | {acc} | "
              f"{'yes' if r.same_as_plain else 'NO'} |")


if __name__ == "__main__":
    main()
