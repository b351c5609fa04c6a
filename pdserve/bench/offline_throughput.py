"""Offline throughput: pdserve `Engine.generate` vs Hugging Face `generate`, same model and prompts.

    python -m pdserve.bench.offline_throughput --num-prompts 64 --min-len 64 --max-len 256 --output-len 64

Without --model-path it builds a random Llama (default: 4 layers, hidden 256,
vocab 32000), the configuration the vLLM CPU comparison in the docs uses.
Both runs are greedy; the script reports how many requests got identical tokens.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch


def build_model(out: Path, layers: int, hidden: int, vocab: int) -> Path:
    from pdserve.testing import build_random_model

    return build_random_model(out, "llama", hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                              num_kv_heads=max(1, hidden // 128), intermediate_size=hidden * 11 // 4,
                              vocab_size=vocab, max_position_embeddings=4096)


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_pdserve(model_dir: Path, prompts: list[list[int]], output_len: int, args: argparse.Namespace
                ) -> tuple[float, list[list[int]]]:
    from pdserve import Engine

    params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    with Engine(model_path=str(model_dir), max_total_tokens=args.max_total_tokens,
                chunked_prefill_size=args.chunked_prefill_size, disable_radix_cache=True,
                disable_decode_kv_mirror=args.disable_decode_kv_mirror) as engine:
        engine.generate(input_ids=prompts[:4], sampling_params=dict(params, max_new_tokens=4))  # warm-up
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - t0
    return elapsed, [o["output_ids"] for o in outs]


@torch.inference_mode()
def run_hf(model_dir: Path, prompts: list[list[int]], output_len: int, batch_size: int
           ) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    pad = 0

    def generate(batch: list[list[int]], new: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=pad, eos_token_id=None)
        return out[:, width:].tolist()

    generate(prompts[:4], 4)  # warm-up
    t0 = time.perf_counter()
    outs: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        outs += generate(prompts[i:i + batch_size], output_len)
    return time.perf_counter() - t0, outs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--disable-decode-kv-mirror", action="store_true",
                    help="decode gathers KV from the paged pool every step (the server flag)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_path) if args.model_path else build_model(
            Path(tmp) / "model", args.layers, args.hidden, args.vocab)
        vocab = args.vocab if not args.model_path else 100
        prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab, args.seed)
        n_out = args.num_prompts * args.output_len
        print(f"torch threads: {torch.get_num_threads()}; {args.num_prompts} prompts of "
              f"{args.min_len}-{args.max_len} tokens, {args.output_len} greedy tokens each")
        t_pd, out_pd = run_pdserve(model_dir, prompts, args.output_len, args)
        print(f"pdserve Engine.generate : {t_pd:7.2f} s  {n_out / t_pd:8.1f} output tok/s")
        if not args.skip_hf:
            t_hf, out_hf = run_hf(model_dir, prompts, args.output_len, args.hf_batch_size)
            print(f"HF generate (batch {args.hf_batch_size:3d}): {t_hf:7.2f} s  {n_out / t_hf:8.1f} output tok/s")
            same = sum(a == b for a, b in zip(out_pd, out_hf))
            print(f"pdserve / HF speed: {t_hf / t_pd:.2f}x; identical greedy outputs: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
