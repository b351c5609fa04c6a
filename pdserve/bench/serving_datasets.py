"""The datasets of the serving benchmark (serving.py): ``random`` (token ids drawn from
the server tokenizer's vocabulary, lengths uniform in [len * ratio, len]), ``sharegpt``
(a local ShareGPT JSON: the first human turn is the prompt, the gpt reply's token count
the output length) and ``multiturn`` (chat conversations built from the demo model's
tasks, a warm-up round and a measured round whose prompts extend the warm-up's).

Split from the load (serving_load.py): a dataset only turns a tokenizer and a seed into
``BenchRequest``s, deterministically, and never talks to a server.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import numpy as np

from pdserve.bench.serving_load import BenchRequest


def _special_ids(tokenizer: Any) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", None) or [])


def _n_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float, tokenizer: Any,
                   seed: int = 1) -> list[BenchRequest]:
    """Prompts of random non-special token ids; input and output lengths uniform over
    [max(1, int(len * range_ratio)), len] (range_ratio 1 = exact lengths)."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = np.random.default_rng(seed)
    special = _special_ids(tokenizer)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
    if len(vocab) == 0:
        raise ValueError("the tokenizer has no non-special tokens")
    in_lens = rng.integers(max(1, int(input_len * range_ratio)), input_len + 1, size=num_prompts)
    out_lens = rng.integers(max(1, int(output_len * range_ratio)), output_len + 1, size=num_prompts)
    out = []
    for il, ol in zip(in_lens.tolist(), out_lens.tolist()):
        ids = rng.choice(vocab, size=il).tolist()
        out.append(BenchRequest(text=tokenizer.decode(ids), prompt_len=il, output_len=ol, prompt_ids=ids))
    return out


def _turn_role(turn: dict[str, Any]) -> str:
    return str(turn.get("from", turn.get("role", ""))).lower()


def sharegpt_dataset(path: str | os.PathLike[str], num_prompts: int, tokenizer: Any, seed: int = 1,
                     output_len: int | None = None, context_len: int | None = None) -> list[BenchRequest]:
    """Requests from a ShareGPT JSON (a list of ``{"conversations": [{"from": "human"|"gpt",
    "value": ...}, ...]}``): the first human turn is the prompt and the gpt turn after it
    sets the output length (``output_len`` overrides).  Entries without such a pair,
    with fewer than 2 output tokens, or longer than ``context_len`` are skipped; the
    rest are shuffled with ``seed`` and the first ``num_prompts`` kept."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of ShareGPT entries")
    pairs: list[tuple[str, str]] = []
    for entry in data:
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conv, list):
            continue
        for i, turn in enumerate(conv[:-1]):
            if isinstance(turn, dict) and _turn_role(turn) in ("human", "user"):
                nxt = conv[i + 1]
                if isinstance(nxt, dict) and _turn_role(nxt) in ("gpt", "assistant", "chatgpt", "bard"):
                    pairs.append((str(turn.get("value", "")), str(nxt.get("value", ""))))
                break
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(out) >= num_prompts:
            break
        p_len = _n_tokens(tokenizer, prompt)
        o_len = output_len if output_len is not None else _n_tokens(tokenizer, reply)
        if p_len < 1 or o_len < (1 if output_len is not None else 2):
            continue
        if context_len is not None and p_len + o_len > context_len:
            continue
        out.append(BenchRequest(text=prompt, prompt_len=p_len, output_len=o_len))
    if not out:
        raise ValueError(f"{path}: no usable ShareGPT conversation (human turn followed by a gpt turn)")
    return out


def _render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[int] | None]:
    """The chat-templated prompt and its tokens (plain "role: content" lines without a template)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return text, (tokenizer(text, add_special_tokens=False)["input_ids"] if tokenizer is not None else None)


def multiturn_dataset(num_conversations: int, turns: int, tokenizer: Any, seed: int = 1,
                      output_len: int | None = None) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warm-up round, measured round) of chat conversations built from the demo model's
    tasks (``pdserve.assets.demo_tasks``, training split: questions it knows).

    Each conversation starts with a system prompt shared by many conversations.  The
    warm-up prompt holds ``turns`` user turns (the earlier ones answered with their
    reference answers); the measured prompt is the warm-up prompt with the last question
    answered plus one new question, so its rendered prompt extends the warm-up's.  The
    output length is the reference answer's tokens + 1 (its end of turn) unless given."""
    from pdserve.assets import demo_tasks

    if num_conversations < 1 or turns < 1:
        raise ValueError("--num-conversations and --turns must be >= 1")
    warm, measured = [], []
    for c in range(num_conversations):
        rng = random.Random(f"bench-serving-multiturn-{seed}-{c}")
        system = rng.choice(demo_tasks.SYSTEM_PROMPTS)
        examples = [demo_tasks.sample_example(rng, rng.choice(demo_tasks.TASKS), "train")
                    for _ in range(turns + 1)]
        msgs: list[dict[str, str]] = [{"role": "system", "content": system}]
        for ex in examples[:-1]:
            msgs += [{"role": "user", "content": ex.question}, {"role": "assistant", "content": ex.answer}]
        warm_msgs = msgs[:-1]  # ends with question number `turns`
        measured_msgs = msgs + [{"role": "user", "content": examples[-1].question}]
        for round_msgs, ex, dest in ((warm_msgs, examples[-2], warm), (measured_msgs, examples[-1], measured)):
            text, ids = _render_chat(tokenizer, round_msgs)
            o_len = output_len
            if o_len is None:
                o_len = (_n_tokens(tokenizer, ex.answer) if tokenizer is not None else len(ex.answer)) + 1
            dest.append(BenchRequest(text=text, prompt_len=len(ids) if ids is not None else len(text),
                                     output_len=o_len, prompt_ids=ids, messages=round_msgs))
    return warm, measured
