#!/usr/bin/env python3
"""Held-out exact-match accuracy of a demo model directory, with transformers only.

For each task, N held-out questions (``pdserve.assets.demo_tasks`` hash rule,
full difficulty range; the same sets as ``pdserve.bench.accuracy``) are rendered with the model's chat template
(``add_generation_prompt=True``) and answered by greedy ``generate``; a question
counts when the decoded answer equals the reference exactly.  ``multi-turn``
asks held-out questions after 3 earlier (training-distribution) turns whose
reference answers are given as assistant messages, i.e. a long prompt.

  python scripts/eval_demo_model.py --model pdserve/assets/demo --n 200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdserve.assets import demo_tasks as dt  # noqa: E402


@torch.no_grad()
def _generate(model, tok, cases: list[dt.Conversation], batch: int) -> float:
    hits = 0
    for b in range(0, len(cases), batch):
        chunk = cases[b : b + batch]
        prompts = [tok.apply_chat_template(list(c.messages), add_generation_prompt=True, tokenize=False)
                   for c in chunk]
        # The template already starts with <s>; left padding so all prompts end together.
        enc = tok(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
        max_new = max(len(c.answer) for c in chunk) + 2
        out = model.generate(
            **enc, max_new_tokens=max_new, do_sample=False,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )
        for row, case in zip(out[:, enc["input_ids"].shape[1] :], chunk):
            ids = row.tolist()
            if tok.eos_token_id in ids:
                ids = ids[: ids.index(tok.eos_token_id)]
            hits += int(tok.decode(ids, skip_special_tokens=True) == case.answer)
    return hits / len(cases)


def evaluate(model_dir: Path | str, n: int = 200, seed: int = 0, batch: int = 50) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    # The same question sets as `python -m pdserve.bench.accuracy --seed SEED`.
    return {task: _generate(model, tok, dt.heldout_conversations(task, n, seed), batch)
            for task in (*dt.TASKS, "multi-turn")}


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
