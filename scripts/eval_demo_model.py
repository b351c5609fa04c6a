#!/usr/bin/env python3
"""Held-out exact-match accuracy of a demo model directory, with transformers only.

For each task, N held-out questions (``pdserve.assets.demo_tasks`` hash rule,
full difficulty range) are rendered with the model's chat template
(``add_generation_prompt=True``) and answered by greedy ``generate``; a question
counts when the decoded answer equals the reference exactly.  ``multi-turn``
asks held-out questions after 3 earlier (training-distribution) turns whose
reference answers are given as assistant messages, i.e. a long prompt.

  python scripts/eval_demo_model.py --model pdserve/assets/demo --n 200
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdserve.assets import demo_tasks as dt  # noqa: E402


def _multi_turn_sets(n: int, seed: int) -> list[tuple[list[dict[str, str]], str]]:
    rng = random.Random(f"multi-{seed}")
    out = []
    for i in range(n):
        msgs: list[dict[str, str]] = []
        for _ in range(3):
            ex = dt.sample_example(rng, rng.choice(dt.TASKS), "train")
            msgs += [{"role": "user", "content": ex.question}, {"role": "assistant", "content": ex.answer}]
        ex = dt.sample_example(rng, dt.TASKS[i % 3], "heldout")
        out.append((msgs + [{"role": "user", "content": ex.question}], ex.answer))
    return out


@torch.no_grad()
def _generate(model, tok, cases: list[tuple[list[dict[str, str]], str]], batch: int) -> float:
    hits = 0
    for b in range(0, len(cases), batch):
        chunk = cases[b : b + batch]
        prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m, _ in chunk]
        # The template already starts with <s>; left padding so all prompts end together.
        enc = tok(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
        max_new = max(len(a) for _, a in chunk) + 2
        out = model.generate(
            **enc, max_new_tokens=max_new, do_sample=False,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )
        for row, (_, ans) in zip(out[:, enc["input_ids"].shape[1] :], chunk):
            ids = row.tolist()
            if tok.eos_token_id in ids:
                ids = ids[: ids.index(tok.eos_token_id)]
            hits += int(tok.decode(ids, skip_special_tokens=True) == ans)
    return hits / len(cases)


def evaluate(model_dir: Path | str, n: int = 200, seed: int = 0, batch: int = 50) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    res: dict[str, float] = {}
    for task in dt.TASKS:
        cases = [([{"role": "user", "content": e.question}], e.answer) for e in dt.heldout_examples(task, n, seed)]
        res[task] = _generate(model, tok, cases, batch)
    res["multi-turn"] = _generate(model, tok, _multi_turn_sets(n, seed), batch)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO / "pdserve" / "assets" / "demo")
    p.add_argument("--n", type=int, default=200, help="held-out questions per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    res = evaluate(a.model, a.n, a.seed, a.batch)
    for k, v in res.items():
        print(f"{k:12s} {v:.3f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
