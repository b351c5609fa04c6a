"""Synthetic tasks of the embedded demo model: generation, held-out split, checking.

Pure Python (no torch) so that the trainer, the evaluator and the serving
accuracy benchmark all generate questions the same way.

Tasks (user message -> exact assistant answer):
  arithmetic  ``What is A + B?`` -> ``A + B = C``; ``What is A - B?`` -> ``A - B = C``
              with A, B in 0..99 and A >= B for minus.
  copy        ``Repeat: S`` -> ``S``; S is 8..32 distinct characters of [a-z0-9].
  recall      ``Remember: k1=v1, ..., kn=vn. What is kj?`` -> ``vj``; n in 2..16,
              keys are distinct lowercase letters, values 3 characters of [a-z0-9].

Held-out rule: a question (the exact user message text) is held out iff
``is_heldout(question)``, i.e. the first 8 bytes of its SHA-256 digest, read as
a big-endian integer, are 0 modulo 10.  Training never sees held-out questions.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from dataclasses import dataclass
from typing import Literal

TASKS: tuple[str, ...] = ("arithmetic", "copy", "recall")
Split = Literal["train", "heldout"]

ALNUM = string.ascii_lowercase + string.digits
COPY_MIN_LEN, COPY_MAX_LEN = 8, 32
RECALL_MIN_PAIRS, RECALL_MAX_PAIRS = 2, 16
RECALL_VALUE_LEN = 3
OPERAND_MAX = 99

# Short system prompts sometimes used in training so the model tolerates one.
SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are a small demo model. Answer exactly.",
    "Answer the question.",
    "You are pdserve's demo assistant.",
)


@dataclass(frozen=True)
class Example:
    task: str
    question: str
    answer: str


def question_hash(question: str) -> int:
    """Deterministic (unsalted, unlike ``hash``) 64-bit hash of a question."""
    return int.from_bytes(hashlib.sha256(question.encode("utf-8")).digest()[:8], "big")


def is_heldout(question: str) -> bool:
    return question_hash(question) % 10 == 0


def _arithmetic(rng: random.Random) -> Example:
    a, b = rng.randint(0, OPERAND_MAX), rng.randint(0, OPERAND_MAX)
    if rng.random() < 0.5:
        q, ans = f"What is {a} + {b}?", f"{a} + {b} = {a + b}"
    else:
        a, b = max(a, b), min(a, b)
        q, ans = f"What is {a} - {b}?", f"{a} - {b} = {a - b}"
    return Example("arithmetic", q, ans)


def _copy(rng: random.Random, length: int) -> Example:
    s = "".join(rng.sample(ALNUM, length))
    return Example("copy", f"Repeat: {s}", s)


def _recall(rng: random.Random, n_pairs: int) -> Example:
    keys = rng.sample(string.ascii_lowercase, n_pairs)
    values = ["".join(rng.choice(ALNUM) for _ in range(RECALL_VALUE_LEN)) for _ in keys]
    j = rng.randrange(n_pairs)
    pairs = ", ".join(f"{k}={v}" for k, v in zip(keys, values))
    return Example("recall", f"Remember: {pairs}. What is {keys[j]}?", values[j])


def sample_example(
    rng: random.Random,
    task: str,
    split: Split,
    copy_len: tuple[int, int] = (COPY_MIN_LEN, COPY_MAX_LEN),
    recall_pairs: tuple[int, int] = (RECALL_MIN_PAIRS, RECALL_MAX_PAIRS),
) -> Example:
    """Draw one example of ``task`` from ``split`` by rejection on the hash rule.

    ``copy_len`` / ``recall_pairs`` are inclusive ranges (the trainer's
    curriculum narrows them; evaluation uses the full ranges).
    """
    want_heldout = split == "heldout"
    while True:
        if task == "arithmetic":
            ex = _arithmetic(rng)
        elif task == "copy":
            ex = _copy(rng, rng.randint(*copy_len))
        elif task == "recall":
            ex = _recall(rng, rng.randint(*recall_pairs))
        else:
            raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
        if is_heldout(ex.question) == want_heldout:
            return ex


def heldout_examples(task: str, n: int, seed: int = 0) -> list[Example]:
    """``n`` held-out examples of ``task`` over the full difficulty range (deterministic)."""
    rng = random.Random(f"heldout-{task}-{seed}")
    return [sample_example(rng, task, "heldout") for _ in range(n)]


@dataclass(frozen=True)
class Conversation:
    """Chat messages ending with a held-out user question, and its exact answer."""

    task: str
    messages: tuple[dict[str, str], ...]
    answer: str


def heldout_conversations(task: str, n: int, seed: int = 0, prefix_turns: int = 0) -> list[Conversation]:
    """``n`` held-out questions of ``task`` as chats (deterministic).

    ``prefix_turns`` > 0 puts each question after that many earlier
    training-split turns of random tasks with their reference answers: long
    prompts for chunked prefill and KV handoff.  ``task`` "multi-turn" cycles
    through the three tasks with 3 prefix turns.
    """
    if task == "multi-turn":
        return [heldout_conversations(TASKS[i % len(TASKS)], 1, seed * 100003 + i, prefix_turns=3)[0]
                for i in range(n)]
    rng = random.Random(f"heldout-{task}-{seed}-{prefix_turns}")
    out = []
    for _ in range(n):
        msgs: list[dict[str, str]] = []
        for _ in range(prefix_turns):
            ex = sample_example(rng, rng.choice(TASKS), "train")
            msgs += [{"role": "user", "content": ex.question}, {"role": "assistant", "content": ex.answer}]
        ex = sample_example(rng, task, "heldout")
        msgs.append({"role": "user", "content": ex.question})
        out.append(Conversation(task, tuple(msgs), ex.answer))
    return out


_ANSWER_SHAPE = {
    "arithmetic": re.compile(r"\d+ [+-] \d+ = -?\d+"),
    "copy": re.compile(r"[a-z0-9]+"),
    "recall": re.compile(r"[a-z0-9]{%d}" % RECALL_VALUE_LEN),
}


def is_valid_answer(task: str, text: str) -> bool:
    """Whether ``text`` has the shape of a ``task`` answer (right or wrong)."""
    return _ANSWER_SHAPE[task].fullmatch(text) is not None
