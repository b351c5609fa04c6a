#!/usr/bin/env python3
"""Train the embedded demo model (a tiny, nearly character-level LlamaForCausalLM).

Deterministic (seeded, fixed thread count), CPU-only and resumable.  The model
learns three synthetic chat tasks (see ``pdserve/assets/demo_tasks.py``):
arithmetic, copy and key/value recall, in single- and multi-turn conversations.

Key choices (from a failed first feasibility run, see the README of the asset):
  * loss only on assistant answer tokens (+ their closing ``</s>``), averaged per
    answer turn, so long copy answers do not dominate the gradient;
  * a curriculum that widens copy length / recall pair count when held-out
    exact match at the current frontier passes a threshold;
  * rows are whole conversations (never several conversations in one row), so
    the causal mask alone is correct and SDPA can use its fast causal path;
  * the LR stays at its peak until the last 40% of the steps;
  * recall rides on copying: merged tokens make the question's last token and the
    key's list token "the same" (see MERGED), so the copy task's induction heads
    do the lookup (four sessions of recipes never taught the character-level
    two-hop lookup);
  * supervised attention (training only, the export is a plain Llama; see
    SupervisedAttention): the circuits each task needs are named and their
    attention patterns taught directly, which is what fits the whole recipe
    into one ~82-minute run from scratch (the earlier unsupervised recipe took
    five runs and ~230 minutes to reach the bars):
      - a previous-token head (``--prev-attn-*``, layer 1), the first half of
        every induction head;
      - copy heads (``--lookup-attn-*``, layer 3) look at the character they
        are about to emit: the repeated string, the echoed ``A + B``, the
        recalled list value;
      - key heads (``--key-attn-*``, layer 2) carry each recall value
        character's key, so characters 2-3 are not copied by the previous
        character alone;
      - operand heads (``--arith-attn-*``, layer 1) bring A's and B's digits to
        every result position, leaving the MLPs only the sum (arithmetic was the
        slowest task by far without them).
    In one GPU comparison at ~2200 steps, the previous-token head at layer 1
    instead of 0 took copy from 0.02 to 0.9, and the operand heads at layer 1
    (not 2) took arithmetic from 0.1 to 0.5.

Held-out evaluation during training is teacher-forced: the greedy answer is
exactly right iff the argmax at every answer position equals the target, so a
single forward pass gives the same exact-match number as greedy generation.

Typical use. The defaults are the one-run recipe that made the shipped model:
task shares recall 0.3 / copy 0.15 while the LR is at its peak, then recall 0.2 /
copy 0.1 once it decays from 60% of the steps (``--decay-from``,
``--decay-*-share``). On 2 quiet cores it took 82 minutes from scratch and reached
held-out arithmetic 0.957, copy 0.990, recall 1.000 (transformers ``generate``,
300 questions per task). How it was found: the previous recipe (decay from 80%,
shares 0.3 / 0.15 throughout) took 86 minutes and left arithmetic at 0.893; seven
half-length variants on a GPU then showed that arithmetic is limited by its number
of turns, not by the schedule (shares 0.2 / 0.1 gave arithmetic 0.84 against 0.77;
moving the decay start alone from 0.4 to 0.8 changed nothing beyond noise), but
those shares from step 0 starved copy (0.16 at step 1600, its curriculum stuck),
hence the switch at the decay:
  python scripts/train_demo_model.py --threads 2            # fresh run
  python scripts/train_demo_model.py --threads 2 --resume   # continue after a stop
  python scripts/train_demo_model.py --export-only              # export latest ckpt
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from pdserve.assets import demo_tasks as dt  # noqa: E402

# ---------------------------------------------------------------------------
# Tokenizer: one token per character, plus special tokens.
# ---------------------------------------------------------------------------

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS, UNK, SYS, USR, AST = range(len(SPECIALS))
# All printable ASCII plus newline and tab, so any plain-ASCII prompt a server
# test sends tokenizes without <unk>.
CHARS = ["\n", "\t"] + [chr(c) for c in range(32, 127)]
# Merged tokens (BPE merges, in this priority order): "?\n", then "k=" and
# "k?\n" for every lowercase letter k.  They make recall a copy: a user turn
# ends with "\n" (the template's assistant marker), so the last prompt token of
# "What is c?" is "c?\n", and a list pair "c=k0k" starts with "c=".  Initialised
# alike, the two are "the same token", and the induction heads that copying
# builds (find the earlier occurrence of the current token, emit what followed)
# answer the lookup.  Character-level, the key sits 2-3 tokens before the
# answer and 2 before the value, a two-hop lookup that no recipe we tried learnt
# (see the asset README).
MERGES = [("?", "\n")] + [(k, "=") for k in string.ascii_lowercase] + [(k, "?\n") for k in string.ascii_lowercase]
MERGED = ["".join(pair) for pair in MERGES]
VOCAB = SPECIALS + CHARS + MERGED
CHAR_ID = {c: i for i, c in enumerate(VOCAB) if i >= len(SPECIALS)}

# <s><|user|>What is 1 + 2?\n1 + 2 = 3</s>  -- the "\n" closing a user turn is
# the only assistant marker (an <|assistant|> token there would stand between
# the question's last character and the answer); <|assistant|> stays in the
# vocabulary, unused.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ '<|system|>' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
)


def text_ids(text: str) -> list[int]:
    """Token ids of plain text, exactly as the tokenizer's BPE merges split it."""
    out, i = [], 0
    while i < len(text):
        for width in range(max(map(len, MERGED)), 0, -1):
            piece = text[i : i + width]
            if len(piece) == width and piece in CHAR_ID:
                out.append(CHAR_ID[piece])
                i += width
                break
        else:
            out.append(UNK)
            i += 1
    return out


def build_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over ``VOCAB`` built with ``tokenizers``.

    BPE over single characters plus the ``MERGES`` above; the Fuse decoder
    joins tokens back without inserted spaces.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(VOCAB)}, merges=MERGES, unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def encode(messages: list[dict[str, str]], key_weight: float = 1.0
           ) -> tuple[list[int], list[float], list[tuple[str, int, int]]]:
    """Token ids of a conversation exactly as the chat template renders it.

    Returns (ids, weights, spans): ``weights[i]`` is the loss weight of
    predicting token i (1/len for each token of an assistant answer incl. its
    ``</s>``, else 0); ``spans`` lists (task, start, end) of answer tokens.
    """
    ids, wts, spans = [BOS], [0.0], []
    for m in messages:
        if m["role"] == "assistant":
            body = text_ids(m["content"]) + [EOS]
            spans.append((m.get("task", ""), len(ids), len(ids) + len(body)))
            wts.extend(answer_weights(m["content"], len(body), m.get("task", ""), key_weight))
        else:
            # A user turn ends with the newline that marks the answer; a system turn with </s>.
            user = m["role"] == "user"
            body = [USR] + text_ids(m["content"] + "\n") if user else [SYS] + text_ids(m["content"]) + [EOS]
            wts.extend([0.0] * len(body))
        ids.extend(body)
    return ids, wts, spans


def answer_weights(answer: str, n: int, task: str = "", key_weight: float = 1.0) -> list[float]:
    """Loss weights of one answer's ``n`` tokens, summing to 1.

    An arithmetic answer ``A + B = C`` is mostly a copy of the question; the
    result digits (and the closing ``</s>``) carry the task, so they get 4x the
    weight of the echoed part instead of drowning in it.  A recall answer's
    first character is the key lookup; the rest follows from it by copying
    (teacher-forced, the model gets characters 2-3 right long before the
    first), so it gets ``key_weight``.
    """
    eq = answer.find(" = ")
    if task == "recall":
        raw = [key_weight] + [1.0] * (n - 1)
    elif eq < 0:
        return [1.0 / n] * n
    else:
        raw = [1.0 if i < eq + 3 else 4.0 for i in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


# ---------------------------------------------------------------------------
# Curriculum and data
# ---------------------------------------------------------------------------

# Recall has the fewest supervised tokens per turn and is learnt last, so it
# gets the most turns.
TASK_PROBS = {"arithmetic": 0.35, "copy": 0.2, "recall": 0.45}
# Curricula start narrow. A narrow range lets the model first solve a task
# with position-specific attention (a stepping stone); each widening then
# costs a short relearning phase (~200 steps) until the circuit generalises.
# Starting wide (copy 8..20, recall 2..4) stayed near chance for 850 steps,
# starting narrow solved copy 8..12 in ~500 steps.
COPY_STEPS = [12, 16, 20, 24, 28, 32]
# Recall starts at up to 4 pairs: with 2 pairs a coin flip is half right, so
# the key-matching gradient is weak and a first run sat at chance for 5000 steps.
RECALL_STEPS = [4, 6, 8, 10, 12, 14, 16]


@dataclass
class Curriculum:
    copy_max: int = COPY_STEPS[0]
    recall_max: int = RECALL_STEPS[0]
    long_row: int = 256  # length of the long (multi-turn) rows; grows with the curriculum
    recall_share: float = TASK_PROBS["recall"]  # fraction of turns that are recall questions
    # Fraction of copy turns; None keeps arithmetic : copy at their TASK_PROBS ratio
    # in whatever recall leaves (a continuation drops copy once it is solved).
    copy_share: float | None = None
    skip_share: float = 0.0  # fraction of training-only "Skip:" turns (see skip_example)

    def long_row_for_progress(self) -> int:
        """Long rows grow with the curriculum: 256 tokens, 512 past half of it, 768 at its end."""
        progress = (COPY_STEPS.index(self.copy_max) + RECALL_STEPS.index(self.recall_max)) / (
            len(COPY_STEPS) + len(RECALL_STEPS) - 2
        )
        return 256 if progress < 0.5 else (512 if progress < 1 else 768)

    def done(self) -> bool:
        return self.copy_max == COPY_STEPS[-1] and self.recall_max == RECALL_STEPS[-1]


def skip_example(rng: random.Random) -> dt.Example:
    """Training-only auxiliary turn ``Skip: S`` -> every other character of S.

    Producing S[i+2] after S[i] is an induction over the token two back, the
    feature recall's key lookup needs at a value (``k=v``: the key sits two
    before the value's first character); copying only ever builds the one-back
    feature, and recall alone leaves it on a long plateau.
    """
    s = "".join(rng.sample(dt.ALNUM, rng.randint(8, 24)))
    return dt.Example("skip", f"Skip: {s}", s[::2])


def sample_turn(rng: random.Random, cur: Curriculum) -> dt.Example:
    if cur.skip_share > 0 and rng.random() < cur.skip_share:
        return skip_example(rng)
    if cur.copy_share is None:
        rest = (1.0 - cur.recall_share) / (TASK_PROBS["arithmetic"] + TASK_PROBS["copy"])
        weights = [TASK_PROBS["arithmetic"] * rest, TASK_PROBS["copy"] * rest, cur.recall_share]
    else:
        weights = [1.0 - cur.recall_share - cur.copy_share, cur.copy_share, cur.recall_share]
    task = rng.choices(["arithmetic", "copy", "recall"], weights=weights)[0]
    # 40% of the time draw from the frontier (hardest current band) so that
    # widening is fast; otherwise uniform over the whole current range, which
    # keeps short examples in the mix.
    lo_c = cur.copy_max - 3 if rng.random() < 0.4 else dt.COPY_MIN_LEN
    lo_r = max(dt.RECALL_MIN_PAIRS, cur.recall_max - 1) if rng.random() < 0.4 else dt.RECALL_MIN_PAIRS
    return dt.sample_example(rng, task, "train", (lo_c, cur.copy_max), (lo_r, cur.recall_max))


def turn_messages(ex: dt.Example) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": ex.question},
        {"role": "assistant", "content": ex.answer, "task": ex.task},
    ]


def recall_followups(rng: random.Random, ex: dt.Example, count: int) -> list[dict[str, str]]:
    """Training-only follow-up turns on a recall turn's list: ``What is k?`` -> its value.

    Each is one more key lookup on a list the model already read, so recall's
    sparse supervision (one lookup per list) gets denser.  The rule that serves
    both formats is "the most recent ``k=`` wins": the question's own list, or
    for a follow-up the previous turn's.  Never a held-out question text.
    """
    pairs = dict(p.split("=") for p in ex.question[len("Remember: "): ex.question.index(". What is")].split(", "))
    out: list[dict[str, str]] = []
    for key in rng.sample(sorted(pairs), min(count, len(pairs))):
        q = f"What is {key}?"
        if not dt.is_heldout(q):
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": pairs[key], "task": "recall"}]
    return out


def sample_conversation(rng: random.Random, cur: Curriculum, row_len: int,
                        followup_prob: float = 0.0) -> list[dict[str, str]]:
    """A conversation that fills up to ``row_len`` tokens (at least one turn)."""
    msgs: list[dict[str, str]] = []
    if rng.random() < 0.2:
        msgs.append({"role": "system", "content": rng.choice(dt.SYSTEM_PROMPTS)})
    length = 1 + sum(len(m["content"]) + 2 for m in msgs)
    while True:
        ex = sample_turn(rng, cur)
        turn = turn_messages(ex)
        if ex.task == "recall" and followup_prob > 0 and rng.random() < followup_prob:
            turn += recall_followups(rng, ex, rng.randint(1, 3))
        n = sum(len(m["content"]) + 2 for m in turn)
        if length + n > row_len and any(m["role"] == "assistant" for m in msgs):
            return msgs
        msgs.extend(turn)
        length += n


def make_batch(
    rng: random.Random, cur: Curriculum, row_len: int, tokens_per_step: int, key_weight: float = 1.0,
    followup_prob: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[str, int, int]]]]:
    rows = max(1, tokens_per_step // row_len)
    encs = [encode(sample_conversation(rng, cur, row_len, followup_prob), key_weight) for _ in range(rows)]
    width = max(len(e[0]) for e in encs)
    ids = torch.full((rows, width), PAD, dtype=torch.long)
    wts = torch.zeros((rows, width))
    for r, (i, w, _) in enumerate(encs):
        ids[r, : len(i)] = torch.tensor(i)
        wts[r, : len(w)] = torch.tensor(w)
    return ids, wts, [e[2] for e in encs]


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


def build_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        use_cache=True,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def build_model(cfg: Any) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    cfg._attn_implementation = "sdpa"  # eager is 2-5x slower on CPU
    return LlamaForCausalLM(cfg)


def grow_vocab(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict from a model with a prefix of ``VOCAB`` (the character-level
    one), grown to the whole vocabulary.

    A merged token starts as its first character ("c=" and "c?\n" as "c", "?\n"
    as "?"), which is what lets the old model's copying heads treat "c?\n" and
    "c=" as the same token from the first step; it is never a target (answers
    are characters), so its output row is <unk>'s.
    """
    emb, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    if emb.size(0) == len(VOCAB):
        return state
    first = [CHAR_ID[t[0]] for t in VOCAB[emb.size(0):]]
    return {
        **state,
        "model.embed_tokens.weight": torch.cat([emb, emb[first]]),
        "lm_head.weight": torch.cat([head, head[UNK].expand(len(first), -1)]),
    }


# ---------------------------------------------------------------------------
# Supervised lookup attention (training only; the exported model is a plain Llama)
# ---------------------------------------------------------------------------

KEY_EQ = {CHAR_ID[k + "?\n"]: CHAR_ID[k + "="] for k in string.ascii_lowercase}


def _recall_keys(ids: list[int], spans: list[tuple[str, int, int]]) -> list[tuple[int, int, int]]:
    """(answer start, answer end, list key position) of every recall answer in one row.

    The token before a recall answer is ``k?\n``; its value is the three tokens
    after the most recent ``k=`` (the question's own list, or for a follow-up
    the previous turn's).
    """
    out = []
    for task, s, e in spans:
        key_eq = KEY_EQ.get(ids[s - 1]) if task == "recall" else None
        if key_eq is not None:
            out.append((s, e, max(i for i in range(s - 1) if ids[i] == key_eq)))
    return out


def lookup_targets(ids: list[int], spans: list[tuple[str, int, int]]) -> list[tuple[int, int]]:
    """(query, target) positions of the copy heads: predicting a recall answer's
    j-th character (at position start-1+j) copies list token key+1+j."""
    return [(s - 1 + j, kp + 1 + j) for s, e, kp in _recall_keys(ids, spans) for j in range(e - s - 1)]


EQUALS = CHAR_ID["="]
# Tasks whose answers (or answer prefix) copy the question: the copy heads'
# targets for them (see copy_targets); recall's come from lookup_targets.
COPY_TASKS = ("copy", "arithmetic")


def copy_targets(ids: list[int], spans: list[tuple[str, int, int]], tasks: tuple[str, ...]) -> list[tuple[int, int]]:
    """(query, target) positions of the copy heads on answers that repeat the question.

    ``Repeat: S\n`` -> ``S``: predicting answer character j (at position
    start-1+j) copies S[j], which ends right before the closing ``\n``.
    ``What is A + B?\n`` -> ``A + B = C``: the echoed ``A + B`` likewise
    copies the characters before the closing ``?\n`` (the result has no source).
    """
    out = []
    for task, s, e in spans:
        if task not in tasks:
            continue
        if task == "copy":
            n = e - s - 1  # answer characters, without </s>
        elif task == "arithmetic":
            n = ids.index(EQUALS, s, e) - s - 1  # "A + B" before " = "
        else:
            continue
        out += [(s - 1 + j, s - 1 - n + j) for j in range(n)]
    return out


OPS = (CHAR_ID["+"], CHAR_ID["-"])


def arith_targets(ids: list[int], spans: list[tuple[str, int, int]]) -> list[list[tuple[int, int]]]:
    """(query, target) positions of operand heads: A's tens, A's units, B's tens, B's units, the operator.

    Every position that predicts a result digit or the closing ``</s>`` of
    ``A + B = C`` looks at one token of the answer's own echo of ``A op B``,
    so the MLPs get the four digits (and, with a fifth head, the operator) and
    learn only the sum or difference.  A one-digit
    operand's "tens" is the token before it (never a digit: the question's
    ``?\n`` or the space after the operator), which reads as zero.
    """
    heads: list[list[tuple[int, int]]] = [[], [], [], [], []]
    for task, s, e in spans:
        if task != "arithmetic":
            continue
        eq = ids.index(EQUALS, s, e)
        op = next(i for i in range(s, eq) if ids[i] in OPS)
        a_units, b_units = op - 2, eq - 2  # "A op B = C": a space on each side of op and =
        sources = (a_units - 1, a_units, b_units - 1, b_units, op)
        for q in range(eq + 1, e - 1):
            for h, src in enumerate(sources):
                heads[h].append((q, src))
    return heads


def prev_targets(ids: list[int]) -> list[tuple[int, int]]:
    """(query, target) positions of a previous-token head: every position looks one back."""
    n = len(ids)
    while n > 1 and ids[n - 1] == PAD:
        n -= 1
    return [(i, i - 1) for i in range(1, n)]


def key_targets(ids: list[int], spans: list[tuple[str, int, int]]) -> list[tuple[int, int]]:
    """(query, target) positions of the key heads: every value character of every
    list looks at its pair's ``k=``, every recall answer character at its ``k?\n``."""
    keys = set(KEY_EQ.values())
    listed = [(kp + j, kp) for kp, t in enumerate(ids[:-3]) if t in keys for j in (1, 2, 3)]
    answers = [(s + j, s - 1) for s, e, _ in _recall_keys(ids, spans) for j in range(e - s - 1)]
    return listed + answers


class SupervisedAttention:
    """Cross-entropy of chosen heads' attention against given target positions.

    Recall's second and third value characters were copied by induction on the
    previous character alone: the run-3 model's last-layer copy heads drift to
    another value sharing that character (~0.8 exact match), and a linear probe
    found no trace of a value character's own key in the residual stream past
    the first character, so nothing could tell the two apart.  Two supervised
    patterns supply it: layer-2 "key heads" (unused ones, by ablation) look
    from every value character and every recall answer character at its key
    token, and the layer-3 copy heads look at the list character they copy
    (``lookup_targets``).  The scores are recomputed from the layer's input
    (captured by a pre-hook) so the forward pass itself keeps SDPA.
    """

    def __init__(self, model: torch.nn.Module, layer: int, heads: list[int]) -> None:
        self.attn = model.model.layers[layer].self_attn
        cfg = model.config
        self.heads = heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.captured: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.attn.register_forward_pre_hook(self._capture, with_kwargs=True)

    @torch.no_grad()
    def reset_scores(self, generator: torch.Generator) -> None:
        """Re-initialise the heads' query and key projections (near-uniform attention).

        For heads given a new role: the run-3 model's unused layer-2 heads have
        logits in the hundreds, and supervising them as they are blew the loss
        up to ~400 and wrecked the model within 50 steps.  Key rows are shared
        by a KV group, so the heads must cover whole groups.
        """
        groups = {h // self.group for h in self.heads}
        assert {h for g in groups for h in range(g * self.group, (g + 1) * self.group)} == set(self.heads), \
            "supervised heads must cover whole KV groups to reset their keys"
        d = self.head_dim
        for h in self.heads:
            w = self.attn.q_proj.weight[h * d:(h + 1) * d]
            w.copy_(torch.randn(w.shape, generator=generator) * 0.02)
        for g in groups:
            w = self.attn.k_proj.weight[g * d:(g + 1) * d]
            w.copy_(torch.randn(w.shape, generator=generator) * 0.02)

    def _capture(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.captured = (hidden, kwargs["position_embeddings"])

    def loss(self, targets: list[list[tuple[int, int]]]) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        assert self.captured is not None, "run the model forward first"
        hidden, (cos, sin) = self.captured
        rows = [r for r, t in enumerate(targets) for _ in t]
        if not rows:
            return hidden.new_zeros(())
        dev = hidden.device
        qpos = torch.tensor([q for t in targets for q, _ in t], device=dev)
        kpos = torch.tensor([k for t in targets for _, k in t], device=dev)
        rows_t = torch.tensor(rows, device=dev)
        b, n, _ = hidden.shape
        q = self.attn.q_proj(hidden).view(b, n, -1, self.head_dim).transpose(1, 2)
        k = self.attn.k_proj(hidden).view(b, n, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        heads = torch.tensor(self.heads, device=dev)
        scores = q[:, heads] @ k[:, heads // self.group].transpose(-1, -2) / math.sqrt(self.head_dim)  # [b, h, n, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).triu(1)
        logp = scores.masked_fill(causal, float("-inf")).log_softmax(-1)
        return -logp[rows_t, :, qpos, kpos].mean()


Targets = list[tuple[int, int]]


@dataclass(frozen=True)
class Supervision:
    """One supervised attention loss: its heads and, per row, one target list for each of them.

    Most losses share one target list among a group of heads; the operand
    heads each have their own (one SupervisedAttention per head).
    """

    name: str
    weight: float
    heads: list[SupervisedAttention]
    targets: Callable[[list[int], list[tuple[str, int, int]]], list[Targets]]

    def loss(self, rows: list[list[int]], spans: list[list[tuple[str, int, int]]]) -> torch.Tensor:
        per_row = [self.targets(ids, row_spans) for ids, row_spans in zip(rows, spans)]
        return sum(head.loss([t[i] for t in per_row]) for i, head in enumerate(self.heads)) / len(self.heads)


def build_supervisions(model: torch.nn.Module, args: argparse.Namespace, reset_keys: bool) -> list[Supervision]:
    """The supervised attention losses the flags switch on (weight > 0)."""
    lookup_tasks = args.lookup_attn_tasks.split(",")
    copy_tasks = tuple(t for t in lookup_tasks if t in COPY_TASKS)
    out = []
    if args.lookup_attn_weight > 0:
        out.append(Supervision(
            "lookup_attn", args.lookup_attn_weight,
            [SupervisedAttention(model, args.lookup_attn_layer, _heads(args.lookup_attn_heads))],
            lambda ids, spans: [(lookup_targets(ids, spans) if "recall" in lookup_tasks else [])
                                + copy_targets(ids, spans, copy_tasks)]))
    if args.key_attn_weight > 0:
        key_heads = SupervisedAttention(model, args.key_attn_layer, _heads(args.key_attn_heads))
        if reset_keys:
            key_heads.reset_scores(torch.Generator().manual_seed(args.seed))
        out.append(Supervision("key_attn", args.key_attn_weight, [key_heads],
                               lambda ids, spans: [key_targets(ids, spans)]))
    if args.prev_attn_weight > 0:
        out.append(Supervision("prev_attn", args.prev_attn_weight,
                               [SupervisedAttention(model, args.prev_attn_layer, _heads(args.prev_attn_heads))],
                               lambda ids, spans: [prev_targets(ids)]))
    if args.arith_attn_weight > 0:
        out.append(Supervision("arith_attn", args.arith_attn_weight,
                               [SupervisedAttention(model, args.arith_attn_layer, [h])
                                for h in _heads(args.arith_attn_heads)],
                               arith_targets))
    return out


# ---------------------------------------------------------------------------
# Teacher-forced held-out evaluation (== greedy exact match, see module doc)
# ---------------------------------------------------------------------------


@torch.no_grad()
def tf_exact_match(model: torch.nn.Module, convs: list[list[dict[str, str]]], batch: int = 64) -> tuple[float, float]:
    """(exact match of the LAST answer, per-token accuracy) over conversations."""
    model.eval()
    hits, tok_hits, tok_total = 0, 0, 0
    for b in range(0, len(convs), batch):
        encs = [encode(c) for c in convs[b : b + batch]]
        width = max(len(e[0]) for e in encs)
        ids = torch.full((len(encs), width), PAD, dtype=torch.long)
        for r, e in enumerate(encs):
            ids[r, : len(e[0])] = torch.tensor(e[0])
        pred = model(input_ids=ids.to(model.device), use_cache=False).logits.argmax(-1).cpu()
        for r, (_, _, spans) in enumerate(encs):
            _, s, e = spans[-1]
            ok = pred[r, s - 1 : e - 1] == ids[r, s:e]
            hits += int(ok.all())
            tok_hits += int(ok.sum())
            tok_total += e - s
    model.train()
    return hits / len(convs), tok_hits / tok_total


def heldout_convs(task: str, n: int, tag: str, copy_len=None, recall_pairs=None, prefix_turns: int = 0):
    """Held-out single-turn (or multi-turn: training-distribution prefix turns) eval set."""
    rng = random.Random(f"train-eval-{tag}-{task}")
    full = Curriculum(COPY_STEPS[-1], RECALL_STEPS[-1])
    out = []
    for _ in range(n):
        msgs: list[dict[str, str]] = []
        for _ in range(prefix_turns):
            msgs += turn_messages(sample_turn(rng, full))
        ex = dt.sample_example(
            rng, task, "heldout",
            copy_len or (dt.COPY_MIN_LEN, dt.COPY_MAX_LEN),
            recall_pairs or (dt.RECALL_MIN_PAIRS, dt.RECALL_MAX_PAIRS),
        )
        out.append(msgs + turn_messages(ex))
    return out


# ---------------------------------------------------------------------------
# Checkpointing
# ---------------------------------------------------------------------------


def save_ckpt(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a crash never leaves a half-written checkpoint


def decay_start(args: argparse.Namespace) -> int:
    """The step at which the LR starts decaying (and the decay-phase task shares apply)."""
    return int(args.total_steps * args.decay_from)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    start = decay_start(args)
    if step < start:
        return args.lr
    t = (step - start) / max(1, args.total_steps - start)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def log(msg: str, logf: Path | None) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if logf is not None:
        with open(logf, "a") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------


def export(ckpt: dict[str, Any], out: Path, eval_n: int, threads: int) -> dict[str, Any]:
    from transformers import GenerationConfig, LlamaConfig

    cfg = LlamaConfig.from_dict(ckpt["config"])
    model = build_model(cfg)
    model.load_state_dict(ckpt["model"])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # config.json + model.safetensors
    gen = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, do_sample=False)
    gen.save_pretrained(out)
    # Legacy single-file layout: the chat template lives in tokenizer_config.json.
    build_tokenizer().save_pretrained(out, save_jinja_files=False)

    import eval_demo_model  # scripts/eval_demo_model.py (transformers generate only)

    torch.set_num_threads(threads)
    res = eval_demo_model.evaluate(out, n=eval_n)
    write_readme(out, ckpt, res, eval_n)
    return res


def training_curve(history: list[dict[str, Any]], rows: int = 16) -> str:
    """A markdown table of about ``rows`` evenly spaced training evaluations."""
    if not history:
        return "(no evaluations recorded)"
    stride = max(1, len(history) // rows)
    picked = history[::stride]
    if picked[-1] is not history[-1]:
        picked.append(history[-1])
    cols = ["arithmetic", "copy", "recall", "multi-turn"]
    lines = ["| step | minutes | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for h in picked:
        lines.append(f"| {h['step']} | {h['time_s'] / 60:.0f} | " + " | ".join(f"{h.get(c, 0):.2f}" for c in cols) + " |")
    return "\n".join(lines)


def supervision_summary(a: dict[str, Any]) -> str:
    """Markdown bullets naming each supervised attention loss a run used (empty if none)."""
    lines = []
    if a.get("prev_attn_weight"):
        lines.append(f"layer {a['prev_attn_layer']} heads {a['prev_attn_heads']} look at the previous token "
                     "(half of an induction head)")
    if a.get("lookup_attn_weight"):
        tasks = a.get("lookup_attn_tasks", "recall").split(",")
        what = {"recall": "each recall answer position at the list character it copies",
                "copy": "each copy answer position at the character of the question it repeats",
                "arithmetic": "each echoed `A + B` position at the question character it repeats"}
        lines.append(f"layer {a['lookup_attn_layer']} heads {a['lookup_attn_heads']} (copy heads) look from "
                     + "; from ".join(what[t] for t in tasks))
    if a.get("arith_attn_weight"):
        operator = " and the operator" if len(a["arith_attn_heads"].split(",")) == 5 else ""
        lines.append(f"layer {a['arith_attn_layer']} heads {a['arith_attn_heads']} look from each arithmetic "
                     f"result position at A's tens, A's units, B's tens, B's units{operator} (one head each)")
    if a.get("key_attn_weight"):
        lines.append(f"layer {a['key_attn_layer']} heads {a['key_attn_heads']} (key heads) look from each recall "
                     "list value character at its `k=` and from each recall answer character at its `k?\\n`")
    return "\n".join(f"  - {line};" if i < len(lines) - 1 else f"  - {line}." for i, line in enumerate(lines))


def write_readme(out: Path, ckpt: dict[str, Any], res: dict[str, Any], eval_n: int) -> None:
    c = ckpt["config"]
    n_params = sum(v.numel() for v in ckpt["model"].values())
    acc = "\n".join(f"| {k} | {v:.3f} |" for k, v in res.items())
    curve = training_curve(ckpt["history"])
    a = ckpt["args"]
    provenance = f"Trained for {ckpt['step']} steps (seed {a['seed']})"
    if a.get("init_from"):
        provenance += (f", starting from the weights of `{Path(a['init_from']).name}` (an earlier export, "
                       "its vocabulary grown by `grow_vocab`); the curve below is this run's")
    else:
        provenance += ", from scratch, in one run"
    provenance += "."
    supervised = supervision_summary(a)
    if supervised:
        provenance += (" Training added supervised attention losses (training only: the exported model is a "
                       "plain Llama; see the trainer's `SupervisedAttention`):\n" + supervised)
    extras = []
    if a.get("recall_followup_prob", 0) > 0 and a.get("recall_followups_from", 0) < a["total_steps"]:
        extras.append("follow-up questions `What is k?` on the previous turn's recall list (answer: its value)")
    if a.get("skip_share", 0) > 0 and a.get("skip_from", 0) < a["total_steps"]:
        extras.append("`Skip: S` -> every other character of S (see the trainer for why)")
    extra_kinds = ("\nTraining also used training-only turn kinds (never evaluated): " + "; ".join(extras) + ".") \
        if extras else ""
    bars = {"arithmetic": 0.95, "copy": 0.95, "recall": 0.9}
    missed = [f"{t} {res.get(t, 0):.3f} < {b}" for t, b in bars.items() if res.get(t, 0) < b]
    status = ("**Status: meets the bars** (arithmetic >= 0.95, copy >= 0.95, recall >= 0.9)." if not missed
              else "**Status: below the bars**: " + ", ".join(missed) + ".")
    text = f"""# pdserve demo model

A tiny (nearly) character-level `LlamaForCausalLM` (GQA, RMSNorm, RoPE, SiLU MLP,
untied head) trained by `scripts/train_demo_model.py` on synthetic chat tasks. It is
the embedded model of pdserve's tests and accuracy benchmark.

- {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, MLP {c['intermediate_size']},
  {c['num_attention_heads']} heads / {c['num_key_value_heads']} KV heads (head dim {c['head_dim']}),
  vocab {c['vocab_size']}, max positions {c['max_position_embeddings']}, {n_params / 1e6:.2f}M parameters, fp32.
- {provenance}

## Tokenizer and chat template

One token per character (printable ASCII, `\\n`, `\\t`), special tokens
`<pad>`=0, `<s>`=1 (bos), `</s>`=2 (eos, ends assistant and system turns), `<unk>`=3,
`<|system|>`=4, `<|user|>`=5, `<|assistant|>`=6 (unused), and 53 BPE merges:
`?\\n`, then `k=` and `k?\\n` for each lowercase letter k. Roles: system, user,
assistant. The template renders

```
<s><|system|>SYSTEM</s><|user|>QUESTION\\nANSWER</s><|user|>QUESTION\\n...
```

The newline that closes a user turn is the assistant marker, so
`add_generation_prompt` adds nothing. Generation ends at `</s>` (`eos_token_id` 2).
The rendered prompt already contains `<s>`: tokenize it with
`add_special_tokens=False` (or use `apply_chat_template(..., tokenize=True)`).

Why the merges: with them the last prompt token of `... What is c?` is `c?\\n` and
the list pair `c=k0k` starts with `c=`; both start as the embedding of `c`, and the
induction heads that copying builds (find the earlier occurrence of the current
token, emit what followed it) answer the lookup. Character by character, the key
sits two tokens before its value and three before the answer, a two-hop lookup that
no recipe tried in four sessions learnt (recall stayed at 1/n).

## Tasks (user message -> exact assistant answer)

- arithmetic: `What is A + B?` -> `A + B = C`, `What is A - B?` -> `A - B = C`;
  A, B integers 0..99 written in decimal, A >= B for minus. Example: `What is 12 + 7?` -> `12 + 7 = 19`.
- copy: `Repeat: S` -> `S`; S is 8..32 distinct characters of `[a-z0-9]`.
- recall: `Remember: k1=v1, k2=v2, ..., kn=vn. What is kj?` -> `vj`; n in 2..16, keys
  distinct lowercase letters, values 3 characters of `[a-z0-9]`.
  Example: `Remember: q=4xa, c=k0k. What is c?` -> `k0k`.

Conversations in training mix these tasks over several turns (up to
~{ckpt['cur']['long_row']} tokens); each answer depends only on its own question.{extra_kinds}

Reproduce: `{reproduce_command(a)}` ({a['threads']} thread(s); it took
{ckpt['history'][-1]['time_s'] / 60:.0f} minutes here, on a 2-core machine).

## Training curve

Teacher-forced held-out exact match during training ({a['eval_n']} questions per task,
full difficulty ranges; equal to greedy exact match, see the trainer's doc):

{curve}

## Held-out rule

A question (the exact user message text) is held out iff

```python
int.from_bytes(hashlib.sha256(question.encode("utf-8")).digest()[:8], "big") % 10 == 0
```

Training only ever uses questions with a non-zero remainder. Generate held-out
questions by rejection sampling with this rule, e.g. with
`pdserve.assets.demo_tasks.heldout_examples(task, n, seed)`.

## Measured accuracy

Held-out exact match of the whole assistant answer, greedy decoding with
transformers `generate`, {eval_n} questions per task, full difficulty ranges
(`python scripts/eval_demo_model.py --model pdserve/assets/demo --n {eval_n}`).
`multi-turn` puts each held-out question after 3 earlier training-style turns.

| task | exact match |
|---|---|
{acc}

{status}
"""
    (out / "README.md").write_text(text)


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


NEVER = 10**9  # a "from step" that never comes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "pdserve" / "assets" / "demo")
    p.add_argument("--ckpt-dir", type=Path, default=Path("/root/pdserve-train-ckpt"))
    p.add_argument("--resume", action="store_true", help="continue from CKPT_DIR/latest.pt")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start a fresh run (new optimizer, schedule and curriculum flags) from the weights of an "
                        "exported model directory, e.g. pdserve/assets/demo, when no checkpoint survived")
    p.add_argument("--overwrite", action="store_true", help="start fresh even if a checkpoint exists")
    p.add_argument("--export-only", action="store_true", help="export CKPT_DIR/latest.pt to OUT and exit")
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop (checkpointed) after this long; 0 = no limit")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--total-steps", type=int, default=5000)
    p.add_argument("--set-total-steps", type=int, default=0,
                   help="with --resume: change the checkpoint's total step count (moves the LR decay)")
    p.add_argument("--tokens-per-step", type=int, default=4096)
    p.add_argument("--short-row", type=int, default=192)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--decay-from", type=float, default=0.6,
                   help="fraction of the steps after which the LR decays (cosine to 0.1x)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-n", type=int, default=64, help="held-out questions per task per training eval")
    p.add_argument("--advance-at", type=float, default=0.9, help="frontier exact match that widens the curriculum")
    # The shipped demo model switched this on at step 1400 of its run (recall's key
    # lookup lagged far behind copying the rest of the value); the defaults replay that.
    p.add_argument("--recall-key-weight", type=float, default=4.0,
                   help="loss weight of a recall answer's first character (relative to the others)")
    p.add_argument("--recall-key-weight-from", type=int, default=NEVER,
                   help="step from which it applies (default never: the key heads made it unnecessary)")
    # Likewise switched on at step 2073: follow-up questions on a recall turn's list.
    p.add_argument("--recall-followup-prob", type=float, default=0.5,
                   help="chance that a recall turn gets 1-3 follow-up questions on its list")
    p.add_argument("--recall-followups-from", type=int, default=0, help="step from which they are added")
    p.add_argument("--recall-share", type=float, default=0.3, help="fraction of recall turns (from the step below)")
    p.add_argument("--recall-share-from", type=int, default=0, help="step from which it applies")
    p.add_argument("--copy-share", type=float, default=0.15,
                   help="fraction of copy turns (default: arithmetic and copy keep their ratio)")
    # Copy and recall need their turns early (the induction circuits); arithmetic
    # mostly improves once the LR decays, so the decay phase gives it more turns.
    p.add_argument("--decay-recall-share", type=float, default=0.2,
                   help="fraction of recall turns once the LR decays (see --decay-from)")
    p.add_argument("--decay-copy-share", type=float, default=0.1,
                   help="fraction of copy turns once the LR decays")
    p.add_argument("--skip-share", type=float, default=0.15, help="fraction of auxiliary Skip: turns")
    p.add_argument("--recall-full-from", type=int, default=NEVER,
                   help="step from which recall lists use the full 2..16 range (ends its curriculum)")
    p.add_argument("--skip-from", type=int, default=NEVER,
                   help="step from which they are added (default never: the supervised heads made them unnecessary)")
    p.add_argument("--lookup-attn-weight", type=float, default=1.0,
                   help="weight of the supervised lookup attention loss (see SupervisedAttention); 0 = off")
    p.add_argument("--lookup-attn-layer", type=int, default=3, help="layer whose heads it supervises")
    p.add_argument("--lookup-attn-heads", default="2,3,4,5,6,7",
                   help="comma-separated heads it supervises (the shipped model's copying heads)")
    p.add_argument("--lookup-attn-tasks", default="recall,copy,arithmetic",
                   help="comma-separated answers whose copying the lookup heads are supervised on: recall (the "
                        "list value), copy (the repeated string), arithmetic (the echoed A + B)")
    p.add_argument("--prev-attn-weight", type=float, default=1.0,
                   help="weight of a supervised previous-token attention loss (the half of an induction head "
                        "that copying needs first); 0 = off")
    p.add_argument("--prev-attn-layer", type=int, default=1, help="layer whose heads it supervises")
    p.add_argument("--prev-attn-heads", default="0,1", help="comma-separated heads it supervises")
    p.add_argument("--arith-attn-weight", type=float, default=1.0,
                   help="weight of a supervised operand attention loss for arithmetic results (see "
                        "arith_targets); 0 = off")
    p.add_argument("--arith-attn-layer", type=int, default=1, help="layer whose heads it supervises")
    p.add_argument("--arith-attn-heads", default="2,3,4,5",
                   help="four or five comma-separated heads: A's tens, A's units, B's tens, B's units "
                        "(and the operator)")
    p.add_argument("--key-attn-weight", type=float, default=1.0,
                   help="weight of the supervised key-head attention loss (see SupervisedAttention); 0 = off")
    p.add_argument("--key-attn-layer", type=int, default=2, help="layer whose heads it supervises")
    p.add_argument("--key-attn-heads", default="0,1", help="comma-separated heads it supervises")
    p.add_argument("--key-attn-reset", action=argparse.BooleanOptionalAction, default=True,
                   help="re-initialise the key heads' query/key projections at the start (off when continuing "
                        "from a model whose key heads were already trained)")
    p.add_argument("--device", default="cpu", help="torch device (the recipe is tuned and timed on the CPU)")
    p.add_argument("--ckpt-minutes", type=float, default=5.0)
    p.add_argument("--final-eval-n", type=int, default=300, help="questions per task for the exported README")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    return p


# Flags that do not change what is trained.
_NOT_RECIPE = {"threads", "out", "ckpt_dir", "resume", "overwrite", "export_only", "max_minutes", "ckpt_minutes",
               "set_total_steps", "device", "final_eval_n"}


def reproduce_command(args: dict[str, Any]) -> str:
    """The trainer command line that replays a run (its non-default recipe flags)."""
    defaults = vars(build_parser().parse_args([]))
    flags = [(f"--{k.replace('_', '-')}" if v else f"--no-{k.replace('_', '-')}") if isinstance(v, bool)
             else f"--{k.replace('_', '-')} {v}" for k, v in args.items()
             if k in defaults and k not in _NOT_RECIPE and v is not None and str(v) != str(defaults[k])]
    return " ".join(["python scripts/train_demo_model.py", *flags])


# Recipe flags newer than some checkpoints, with the value those runs used.
_RECIPE_FALLBACKS = {"decay_from": 0.8, "decay_recall_share": None, "decay_copy_share": None}


def restore_recipe(args: argparse.Namespace, saved: dict[str, Any], logf: Path | None) -> None:
    """Make a resumed run the same run: every recipe flag comes from the checkpoint.

    Only the flags in _NOT_RECIPE (threads, time limits, paths, device) may change
    on resume; a different recipe flag on the command line is ignored, and said so.
    """
    ignored = []
    for k, cli_value in vars(args).items():
        if k in _NOT_RECIPE:
            continue
        value = saved.get(k, _RECIPE_FALLBACKS.get(k, cli_value))
        if str(value) != str(cli_value):
            ignored.append(f"--{k.replace('_', '-')} {cli_value} (checkpoint: {value})")
        setattr(args, k, value)
    if ignored:
        log("resume keeps the checkpoint's recipe; ignored: " + ", ".join(ignored), logf)


def _heads(flag: str) -> list[int]:
    return [int(h) for h in flag.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.eval_n < 3:  # the multi-turn eval set takes eval_n // 3 questions per task
        parser.error(f"--eval-n {args.eval_n} must be >= 3")
    if not 0.0 < args.decay_from <= 1.0:
        parser.error(f"--decay-from {args.decay_from} must be in (0, 1]")
    if args.copy_share is not None and not (0.0 <= args.copy_share <= 1.0 - args.recall_share):
        parser.error(f"--copy-share {args.copy_share} must be in [0, 1 - --recall-share]")
    if not (0.0 <= args.decay_recall_share <= 1.0 and 0.0 <= args.decay_copy_share <= 1.0 - args.decay_recall_share):
        parser.error(f"--decay-recall-share {args.decay_recall_share} and --decay-copy-share {args.decay_copy_share} "
                     "must be >= 0 with a sum <= 1")
    bad = set(args.lookup_attn_tasks.split(",")) - {"recall", *COPY_TASKS}
    if bad or not args.lookup_attn_tasks:
        parser.error(f"--lookup-attn-tasks {args.lookup_attn_tasks!r}: each must be one of recall, copy, arithmetic")
    if args.arith_attn_weight > 0 and len(args.arith_attn_heads.split(",")) not in (4, 5):
        parser.error(f"--arith-attn-heads {args.arith_attn_heads!r} must name four or five heads")
    for flag in ("lookup", "key", "prev", "arith"):
        if getattr(args, f"{flag}_attn_weight") < 0:
            parser.error(f"--{flag}-attn-weight must be >= 0")
        if getattr(args, f"{flag}_attn_weight") == 0:
            continue
        layer = getattr(args, f"{flag}_attn_layer")
        if not 0 <= layer < args.layers:
            parser.error(f"--{flag}-attn-layer {layer} must be in [0, --layers)")
        heads = getattr(args, f"{flag}_attn_heads")
        try:
            valid = all(0 <= h < args.heads for h in _heads(heads))
        except ValueError:
            valid = False
        if not valid:
            parser.error(f"--{flag}-attn-heads {heads!r} must be comma-separated heads in [0, --heads)")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    ckpt_path = args.ckpt_dir / "latest.pt"
    logf = args.ckpt_dir / "train.log"

    if args.export_only:
        ckpt = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        res = export(ckpt, args.out, args.final_eval_n, args.threads)
        log(f"exported step {ckpt['step']} to {args.out}: {json.dumps(res)}", None)
        return

    torch.manual_seed(args.seed)
    cfg = build_config(args)
    model = build_model(cfg).to(args.device)
    if args.init_from is not None and not args.resume:
        from safetensors.torch import load_file

        model.load_state_dict(grow_vocab(load_file(str(args.init_from / "model.safetensors"))))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-8,
    )
    rng = random.Random(args.seed)
    # A model grown from an exported one already covers the full ranges.
    cur = Curriculum()
    if args.init_from is not None:
        cur = Curriculum(COPY_STEPS[-1], RECALL_STEPS[-1])
        cur.long_row = cur.long_row_for_progress()
    step, history = 0, []

    if ckpt_path.exists() and not (args.resume or args.overwrite):
        sys.exit(f"{ckpt_path} exists: pass --resume to continue or --overwrite to start fresh")
    if args.resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False, map_location=args.device)
        if ck["config"] != cfg.to_dict() and {k: v for k, v in ck["config"].items() if k != "transformers_version"} != {
            k: v for k, v in cfg.to_dict().items() if k != "transformers_version"
        }:
            sys.exit("checkpoint model config differs from the command line model flags")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        rng.setstate(ck["data_rng"])
        torch.set_rng_state(ck["torch_rng"].cpu())  # map_location moved it to --device
        cur = Curriculum(**ck["cur"])
        step, history = ck["step"], ck["history"]
        restore_recipe(args, ck["args"], logf)
        if args.set_total_steps:
            args.total_steps = args.set_total_steps
        log(f"resumed at step {step}, curriculum {cur}", logf)
    else:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        logf.write_text("")
        n_params = sum(p.numel() for p in model.parameters())
        log(f"fresh run: {n_params / 1e6:.2f}M params, args {vars(args)}", logf)

    # The template rendering and encode() must agree token for token.
    tok = build_tokenizer()
    supervisions = build_supervisions(model, args, args.key_attn_reset and not (args.resume and ckpt_path.exists()))
    probe = sample_conversation(random.Random(0), Curriculum(32, 16), 400)
    clean = [{"role": m["role"], "content": m["content"]} for m in probe]
    rendered = tok.apply_chat_template(clean, tokenize=False)
    assert tok(rendered, add_special_tokens=False)["input_ids"] == encode(probe)[0], "template/encode mismatch"

    def snapshot() -> dict[str, Any]:
        return {
            "model": model.state_dict(), "optim": opt.state_dict(), "data_rng": rng.getstate(),
            "torch_rng": torch.get_rng_state(), "cur": dataclasses.asdict(cur), "step": step,
            "history": history, "config": cfg.to_dict(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        }

    full_sets = {t: heldout_convs(t, args.eval_n, "full") for t in dt.TASKS}
    full_sets["multi-turn"] = [
        c for t in dt.TASKS for c in heldout_convs(t, args.eval_n // 3, "multi", prefix_turns=3)
    ]

    def evaluate() -> dict[str, float]:
        res: dict[str, float] = {}
        for name, convs in full_sets.items():
            res[name], res[name + "_tok"] = tf_exact_match(model, convs)
        fc = heldout_convs("copy", args.eval_n, f"front{cur.copy_max}", copy_len=(cur.copy_max - 3, cur.copy_max))
        fr = heldout_convs("recall", args.eval_n, f"front{cur.recall_max}",
                           recall_pairs=(max(2, cur.recall_max - 1), cur.recall_max))
        res["copy_front"], _ = tf_exact_match(model, fc)
        res["recall_front"], _ = tf_exact_match(model, fr)
        return res

    # Minutes in the curve count training time across resumes.
    t_start = time.time() - (history[-1]["time_s"] if history else 0)
    t_run = time.time()
    t_ckpt = t_run
    def fresh_agg() -> dict[str, list[float]]:
        return {"loss": [], "ntok": [], **{sup.name: [] for sup in supervisions}}

    agg = fresh_agg()
    task_loss: dict[str, list[float]] = {t: [0.0, 0] for t in (*dt.TASKS, "skip")}
    t_log = time.time()
    model.train()
    while step < args.total_steps:
        # Alternate short rows (1-2 turns, prompt near position 0 as in the
        # benchmark) and long multi-turn rows (long prompts for serving).
        row = args.short_row if step % 2 == 0 else cur.long_row
        key_weight = args.recall_key_weight if step >= args.recall_key_weight_from else 1.0
        followups = args.recall_followup_prob if step >= args.recall_followups_from else 0.0
        if step >= args.recall_share_from:
            cur.recall_share = args.recall_share
            cur.copy_share = args.copy_share
        if args.decay_recall_share is not None and step >= decay_start(args):  # None: a checkpoint from before
            cur.recall_share = args.decay_recall_share
            cur.copy_share = args.decay_copy_share
        if step >= args.skip_from:
            cur.skip_share = args.skip_share
        if step >= args.recall_full_from:
            cur.recall_max = RECALL_STEPS[-1]
        ids, wts, spans = make_batch(rng, cur, row, args.tokens_per_step, key_weight, followups)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        ids_d = ids.to(args.device)
        logits = model(input_ids=ids_d, use_cache=False).logits[:, :-1]
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids_d[:, 1:].reshape(-1), reduction="none")
        ce = ce.view(ids.size(0), -1) * wts[:, 1:].to(args.device)
        n_turns = sum(len(s) for s in spans)
        loss = ce.sum() / n_turns  # mean over answer turns of the mean token CE
        rows = ids.tolist()
        for sup in supervisions:
            sup_loss = sup.loss(rows, spans)
            agg[sup.name].append(float(sup_loss.detach()))
            loss = loss + sup.weight * sup_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1

        with torch.no_grad():
            for r, row_spans in enumerate(spans):
                for task, s, e in row_spans:
                    task_loss[task][0] += float(ce[r, s - 1 : e - 1].sum())
                    task_loss[task][1] += 1
        agg["loss"].append(loss.item())
        agg["ntok"].append(ids.numel())

        if step % 25 == 0:
            dt_s = time.time() - t_log
            per_task = " ".join(f"{t}={v[0] / max(1, v[1]):.3f}" for t, v in task_loss.items())
            log(f"step {step} loss {sum(agg['loss']) / len(agg['loss']):.4f} [{per_task}] lr {lr_at(step, args):.2e} "
                f"tok/s {sum(agg['ntok']) / dt_s:.0f} cur copy<={cur.copy_max} recall<={cur.recall_max} "
                f"long_row={cur.long_row}"
                + "".join(f" {sup.name} {sum(agg[sup.name]) / len(agg[sup.name]):.3f}"
                          for sup in supervisions if agg[sup.name]), logf)
            agg = fresh_agg()
            task_loss = {t: [0.0, 0] for t in (*dt.TASKS, "skip")}
            t_log = time.time()

        if step % args.eval_every == 0 or step == args.total_steps:
            t_e = time.time()
            res = evaluate()
            # Widen the curriculum when the frontier band is (nearly) solved.
            if res["copy_front"] >= args.advance_at and cur.copy_max < COPY_STEPS[-1]:
                cur.copy_max = COPY_STEPS[COPY_STEPS.index(cur.copy_max) + 1]
            if res["recall_front"] >= args.advance_at and cur.recall_max < RECALL_STEPS[-1]:
                cur.recall_max = RECALL_STEPS[RECALL_STEPS.index(cur.recall_max) + 1]
            cur.long_row = cur.long_row_for_progress()
            history.append({"step": step, "time_s": round(time.time() - t_start), **{k: round(v, 4) for k, v in res.items()}})
            log(f"eval step {step} ({time.time() - t_e:.0f}s): " + " ".join(f"{k}={v:.3f}" for k, v in res.items())
                + f" -> cur {cur}", logf)

        stop = args.max_minutes > 0 and time.time() - t_run > args.max_minutes * 60
        if time.time() - t_ckpt > args.ckpt_minutes * 60 or stop or step == args.total_steps:
            save_ckpt(ckpt_path, snapshot())
            t_ckpt = time.time()
            log(f"checkpoint step {step} -> {ckpt_path}", logf)
        if stop:
            log(f"--max-minutes reached at step {step}; resume with --resume", logf)
            return

    res = export(snapshot(), args.out, args.final_eval_n, args.threads)
    log(f"finished {step} steps; exported to {args.out}: {json.dumps(res)}", logf)


if __name__ == "__main__":
    main()
