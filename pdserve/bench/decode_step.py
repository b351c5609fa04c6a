"""Time of one decode step with long contexts, decode KV mirror on vs off.

    python -m pdserve.bench.decode_step --batch 8 --min-len 384 --max-len 640 --new 256 --threads 1

A step's time is (time to generate NEW+1 tokens - time to generate 1) / NEW for the
same prompts, so prefill cancels out. Engines with and without the mirror are
alternated (``--rounds`` each) so that machine noise hits both; greedy outputs
must be identical.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def step_ms(model: str, prompts: list[list[int]], new: int, disable_mirror: bool) -> tuple[float, list]:
    from pdserve import Engine

    params = {"temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=model, disable_radix_cache=True, disable_decode_kv_mirror=disable_mirror) as engine:
        engine.generate(input_ids=prompts[:2], sampling_params=dict(params, max_new_tokens=4))  # warm-up
        # The prefill-only time is the best of three: one run slowed by a neighbour
        # would otherwise exceed the full run's and make the step time negative.
        one = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params=dict(params, max_new_tokens=1))
            one = min(one, time.perf_counter() - t0)
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=dict(params, max_new_tokens=new + 1))
        full = time.perf_counter() - t0
    return (full - one) / new * 1e3, [o["output_ids"] for o in outs]


def main(argv: list[str] | None = None) -> None:
    from pdserve import assets

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the embedded demo model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=384)
    ap.add_argument("--max-len", type=int, default=640)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model_path or str(assets.path("demo"))
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 100) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.batch)]
    print(f"torch threads {torch.get_num_threads()}; {args.batch} prompts of {args.min_len}-{args.max_len} "
          f"tokens, {args.new} greedy tokens each")
    results: dict[bool, list[float]] = {False: [], True: []}
    outputs = {}
    for _ in range(args.rounds):
        for disable in (True, False):
            ms, outputs[disable] = step_ms(model, prompts, args.new, disable)
            results[disable].append(ms)
    for disable, label in ((True, "gather from the pool (--disable-decode-kv-mirror)"), (False, "decode KV mirror")):
        print(f"{label:52s} decode step ms: " + " / ".join(f"{x:.2f}" for x in results[disable]))
    best = {k: min(v) for k, v in results.items()}
    print(f"mirror / gather speed (best of each): {best[True] / best[False]:.2f}x; "
          f"identical greedy outputs: {outputs[True] == outputs[False]}")


if __name__ == "__main__":
    main()
