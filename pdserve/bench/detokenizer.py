"""Detokenizer cost per output token by output length (issue 39).

    python -m pdserve.bench.detokenizer                       # demo tokenizer, 1k / 32k / 128k
    python -m pdserve.bench.detokenizer --lengths 1024 32768 --stops 16 --stop-chars 256

One sample streams one token per update, as a decode step sends it. For each output
length N the first N - K tokens arrive in one (untimed) update, then K single-token
updates are timed: their mean is the cost of one more token at output length N. With
``--stops S`` the request carries S stop strings of ``--stop-chars`` characters that
never match (the hold-back check's worst case: no early exit).

Only `Detokenizer.process` and the message types are used, so the same script measures
another checkout of pdserve (``PYTHONPATH=/path/to/checkout python pdserve/bench/detokenizer.py``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from pdserve.sampling_params import SamplingParams
from pdserve.server.detokenizer import Detokenizer
from pdserve.server.messages import TokenUpdate
from pdserve.tokenizer import load_tokenizer


def update(ids: list[int], params: SamplingParams | None, finish: dict[str, Any] | None = None) -> TokenUpdate:
    return TokenUpdate(rid="bench", index=0, new_ids=tuple(ids), new_logprobs=(), new_top_logprobs=(),
                       finish=finish, prompt_tokens=1, cached_tokens=0, completion_tokens=0, retractions=0,
                       spec_verify_ct=0, spec_accepted_drafts=0, params=params)


def per_token_us(tokenizer: Any, length: int, timed: int, params: SamplingParams, budget_s: float,
                 seed: int = 0) -> tuple[float, float, int]:
    """Mean and median microseconds of one single-token update at output length `length`,
    and how many updates were timed (fewer than `timed` when `budget_s` ran out)."""
    rng = random.Random(seed)
    specials = set(getattr(tokenizer, "all_special_ids", ()))
    ordinary = [i for i in range(len(tokenizer)) if i not in specials]
    ids = [rng.choice(ordinary) for _ in range(length)]
    detok = Detokenizer(tokenizer)
    head = length - timed
    detok.process(update(ids[:head], params))
    times: list[float] = []
    for t in ids[head:]:
        start = time.perf_counter()
        detok.process(update([t], None))
        times.append(time.perf_counter() - start)
        if sum(times) > budget_s and len(times) >= 3:
            break
    detok.process(update([], None, {"type": "length"}))
    return statistics.mean(times) * 1e6, statistics.median(times) * 1e6, len(times)


def main(argv: list[str] | None = None) -> None:
    from pdserve import assets

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the demo model's)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 32768, 131072])
    ap.add_argument("--timed", type=int, default=200, help="single-token updates timed per length")
    ap.add_argument("--budget-s", type=float, default=5.0, help="stop timing a length after this long")
    ap.add_argument("--stops", type=int, default=0, help="stop strings per request (never matching)")
    ap.add_argument("--stop-chars", type=int, default=256, help="characters per stop string")
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer or assets.path("demo"))
    # Stop strings of a character the token stream never produces: no prefix ever matches.
    stops = tuple("\x01" * (args.stop_chars - 1) + chr(0x2460 + i) for i in range(args.stops))
    params = SamplingParams(stop=stops)
    print(f"stop strings: {args.stops} x {args.stop_chars} characters")
    print("| output tokens | mean per token (us) | median (us) | updates timed |")
    print("|---:|---:|---:|---:|")
    for length in args.lengths:
        mean, median, n = per_token_us(tokenizer, length, min(args.timed, length - 1), params, args.budget_s)
        print(f"| {length} | {mean:.1f} | {median:.1f} | {n} |", flush=True)


if __name__ == "__main__":
    main()
