"""Section 4's Hugging Face row of the bench_all.sh report (``python -m pdserve.bench.report
hf-generate``): the same prompts as ``bench.serving --dataset-name random`` with the same
flags and seed (same tokenizer, same token ids), answered by ``model.generate`` in static
batches of ``--max-concurrency`` (left-padded, greedy, EOS ignored; a batch runs until its
longest request is done, as HF has no continuous batching). A streamer timestamps every
decoding step, so each request gets TTFT, ITL and E2E like a streamed server response
(its E2E ends at its own last token); the record has bench.serving's metric names.

Split from report.py because it is a load generator, not rendering: it runs a model
and writes a bench.serving-shaped record that the report then reads like the others.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from datetime import datetime
from typing import Any


def hf_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from pdserve.bench.serving_datasets import random_dataset
    from pdserve.bench.serving_load import RequestRecord
    from pdserve.bench.serving_metrics import _jsonable, compute_metrics
    from pdserve.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.tokenizer or args.model)
    reqs = random_dataset(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                          tok, args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    @torch.inference_mode()
    def run_batch(batch: list[Any], new: int) -> tuple[float, list[float]]:
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        clock = Clock()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=pad, eos_token_id=None, streamer=clock)
        return t0, clock.times[-new:]  # the first put is the prompt; then one per generated token

    for _ in range(max(0, args.warmup_requests)):
        run_batch(reqs[:1], min(4, reqs[0].output_len))
    records: list[RequestRecord] = []
    start = time.perf_counter()
    for i in range(0, len(reqs), args.max_concurrency):
        batch = reqs[i:i + args.max_concurrency]
        t0, times = run_batch(batch, max(r.output_len for r in batch))
        for r in batch:
            mine = times[:r.output_len]
            records.append(RequestRecord(success=True, prompt_len=r.prompt_len, output_len=r.output_len,
                                         ttft=mine[0] - t0, itl=[b - a for a, b in zip(mine, mine[1:])],
                                         latency=mine[-1] - t0, start_time=t0 - start))
    duration = time.perf_counter() - start
    m = compute_metrics(records, duration)
    print(f"HF generate: {m.completed} requests in {duration:.2f} s, {m.output_throughput:.1f} output tok/s, "
          f"TTFT mean {m.mean_ttft_ms:.1f} ms, TPOT mean {m.mean_tpot_ms:.1f} ms (torch threads "
          f"{torch.get_num_threads()})")
    if args.output_file:
        rec = {"date": datetime.now().isoformat(timespec="seconds"), "backend": "hf-generate",
               "dataset_name": "random", "round": None, "model": args.model, "request_rate": math.inf,
               "max_concurrency": args.max_concurrency, "interrupted": False, "num_requests": len(reqs),
               **asdict(m), "args": {k: v for k, v in vars(args).items() if k != "func"}}
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(_jsonable(rec)) + "\n")
    return 0
