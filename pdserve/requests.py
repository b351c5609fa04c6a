"""From user input to scheduler messages: validation and sample groups.

Shared by the offline Engine and the HTTP server, so both refuse the same
inputs with the same messages. Every message names the offending field as the
caller's API spells it (`ApiFields`): `max_tokens` on the OpenAI routes,
`max_new_tokens` on /generate and the Engine.

Where each kind of check happens (HTTP server; the Engine enters at 3):
1. `server/protocol.py`: the JSON shape, types and unknown fields (pydantic), and
   fields that would change results but are not implemented (`refuse_unsupported`).
2. The route (`server/openai_requests.py`, `server/native_routes.py`): rules of one API
   (model name, logprobs ranges, echo, prompt logprobs, the chat template) and the
   OpenAI token budget in its own names (`check_new_tokens`).
3. Here: prompts, sampling parameters (`SamplingParams` checks its own ranges; a
   schema, regex or grammar is parsed by the grammar library), the
   `--max-n` limit, logprob arguments, lengths against the context, rids and the
   disaggregation addresses; the result is one `NewRequest` per prompt.
4. `TokenizerManager.submit`: only what depends on the server's state (alive, rid
   not already in flight).
5. The scheduler: what only it can know (a room in use, an unreachable prefill
   server); such a request finishes aborted with the reason.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from pdserve.sampling_params import MAX_NEW_TOKENS, SamplingParams
from pdserve.scheduler.grammar import check_constraint
from pdserve.scheduler.messages import Bootstrap, NewRequest



@dataclass(frozen=True)
class ApiFields:
    """How the calling API names the fields that validation messages mention."""
    max_new_tokens: str = "max_new_tokens"
    min_new_tokens: str = "min_new_tokens"


NATIVE_FIELDS = ApiFields()
# A prompt with more characters than this many per token of the context is refused before it
# is tokenized (tokenizing costs time and memory in proportion to its length): it could only
# fit if its tokens averaged longer than this, which real tokenizers' tokens do not.
MAX_CHARS_PER_TOKEN = 32


def sample_seed(base: int, index: int) -> int:
    """Seed of sample `index` of a request whose first sample uses `base`."""
    if index == 0:
        return base
    return random.Random(f"{base}:{index}").getrandbits(63)


def prompt_logprob_entries(prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], start: int,
                           top_logprobs_num: int) -> int:
    """How many logprob entries the prompts' logprobs take in the response: each prompt
    token from `start` on has its logprob and `top_logprobs_num` alternatives, repeated in
    the result of every sample (`n`)."""
    if start < 0:
        return 0
    return sum((len(ids) - start) * (1 + top_logprobs_num) * p.n for ids, p in zip(prompts, params))


def check_text(text: str, field_name: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate such as "\\ud800", which
    JSON can carry): the tokenizer would fail on it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field_name}: is not valid Unicode (unpaired surrogate at position {exc.start})") \
            from None


class RequestBuilder:
    def __init__(self, tokenizer: Any, context_len: int, vocab_size: int, max_n: int,
                 random_seed: int | None) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.max_n = max_n
        self._rng = random.Random(random_seed)

    @property
    def max_prompt_chars(self) -> int:
        return self.context_len * MAX_CHARS_PER_TOKEN

    def check_chars(self, chars: int, field_name: str, what: str = "") -> None:
        """Refuse text too long to fit the context whatever its tokens (before tokenizing)."""
        if chars > self.max_prompt_chars:
            raise ValueError(f"{field_name}: {what}{chars} characters cannot fit the context length "
                             f"{self.context_len} (at most {self.max_prompt_chars}: {MAX_CHARS_PER_TOKEN} "
                             "characters per token)")

    def token_ids(self, prompt: Any, input_ids: Any, prompt_field: str = "prompt",
                  ids_field: str = "input_ids") -> tuple[list[list[int]], bool]:
        """Normalise a prompt (str | [str]) or input_ids ([int] | [[int]]) to a list of
        token lists; the flag says whether a single prompt was given."""
        if (prompt is None) == (input_ids is None):
            raise ValueError(f"{prompt_field}: exactly one of {prompt_field} and {ids_field} must be given")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else prompt
            if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError(f"{prompt_field}: must be a string or a non-empty list of strings")
            for t in texts:
                self.check_chars(len(t), prompt_field)
                check_text(t, prompt_field)
            ids = [self.tokenizer(t)["input_ids"] for t in texts]
        else:
            if not isinstance(input_ids, (list, tuple)) or not input_ids:
                raise ValueError(f"{ids_field}: must be a non-empty list of token ids or of lists")
            single = not isinstance(input_ids[0], (list, tuple))
            ids = [list(input_ids)] if single else [list(x) for x in input_ids]
            for seq in ids:
                if len(seq) >= self.context_len:  # as check_lengths would, before a check per id
                    raise ValueError(f"prompt: {len(seq)} tokens do not fit the context length {self.context_len}")
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
                    raise ValueError(f"{ids_field}: token ids must be integers")
                bad = [t for t in seq if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"{ids_field}: token id {bad[0]} is outside the vocabulary "
                                     f"[0, {self.vocab_size})")
        for seq in ids:
            if not seq:
                raise ValueError(f"{prompt_field}: is empty (no tokens)")
        return ids, single

    def sampling_params(self, sampling_params: Any, n_prompts: int) -> list[SamplingParams]:
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n_prompts:
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {n_prompts} prompts")
            return [SamplingParams.from_dict(p) for p in sampling_params]
        return [SamplingParams.from_dict(sampling_params)] * n_prompts

    def check_lengths(self, ids: Sequence[int], p: SamplingParams, names: ApiFields = NATIVE_FIELDS) -> None:
        if len(ids) >= self.context_len:
            raise ValueError(f"prompt: {len(ids)} tokens do not fit the context length {self.context_len}")
        field_name = names.max_new_tokens
        if len(ids) + p.max_new_tokens > self.context_len:
            raise ValueError(f"{field_name}: prompt ({len(ids)} tokens) + {field_name} "
                             f"({p.max_new_tokens}) exceeds the context length {self.context_len}")

    def check_stop_token_ids(self, p: SamplingParams) -> None:
        """Stop token ids must be the model's (SamplingParams checked their count and type)."""
        bad = next((t for t in p.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    @staticmethod
    def check_logprob_args(return_logprob: Any, top_logprobs_num: Any) -> None:
        if not isinstance(return_logprob, bool):
            raise ValueError("return_logprob: must be a boolean")
        if not isinstance(top_logprobs_num, int) or isinstance(top_logprobs_num, bool) \
                or not 0 <= top_logprobs_num <= 20:
            raise ValueError(f"top_logprobs_num: must be an integer in [0, 20], got {top_logprobs_num!r}")

    @staticmethod
    def check_logprob_start_len(start: Any, prompts: list[list[int]]) -> None:
        """SGLang's logprob_start_len: -1 (output logprobs only) or a position of every prompt."""
        if not isinstance(start, int) or isinstance(start, bool) or start < -1:
            raise ValueError(f"logprob_start_len: must be -1 (no prompt logprobs) or a prompt position >= 0, "
                             f"got {start!r}")
        for ids in prompts:
            if start >= len(ids):
                raise ValueError(f"logprob_start_len: {start} is beyond the prompt ({len(ids)} tokens: "
                                 f"positions 0 to {len(ids) - 1})")

    def build(self, prompts: list[list[int]], params: list[SamplingParams], return_logprob: Any,
              top_logprobs_num: Any, rids: list[str] | None = None,
              bootstrap: list[tuple[Bootstrap, ...]] | None = None, names: ApiFields = NATIVE_FIELDS,
              logprob_start_len: Any = -1, max_prompt_logprob_entries: int | None = None,
              prompt_logprobs_field: str = "logprob_start_len") -> list[NewRequest]:
        """Check what the prompts ask for as a whole and build one message per prompt.
        ``bootstrap``: per prompt, one address per sample (see `bootstrap_addresses`).
        ``logprob_start_len`` >= 0: prompt logprobs from there on, when logprobs are asked.
        ``max_prompt_logprob_entries``: the most prompt logprob entries the response may carry
        (`prompt_logprob_entries`; the server's --max-prompt-logprob-entries, None: no limit);
        ``prompt_logprobs_field`` is the field a refusal names."""
        for p in set(params):
            if p.n > self.max_n:
                raise ValueError(f"n: {p.n} is above the limit {self.max_n} (--max-n)")
            self.check_stop_token_ids(p)
            check_constraint(p)
        self.check_logprob_args(return_logprob, top_logprobs_num)
        self.check_logprob_start_len(logprob_start_len, prompts)
        if not (return_logprob or top_logprobs_num):
            logprob_start_len = -1  # as SGLang: without return_logprob nothing is computed
        if max_prompt_logprob_entries is not None:
            entries = prompt_logprob_entries(prompts, params, logprob_start_len, top_logprobs_num)
            if entries > max_prompt_logprob_entries:
                raise ValueError(f"{prompt_logprobs_field}: the prompt logprobs asked for take {entries} entries "
                                 "in the response (prompt tokens from the start x (1 + top logprobs) x samples), "
                                 f"above the limit {max_prompt_logprob_entries} (--max-prompt-logprob-entries)")
        for ids, p in zip(prompts, params):
            self.check_lengths(ids, p, names)
        if rids is not None and (len(rids) != len(prompts) or len(set(rids)) != len(rids)):
            raise ValueError("rid: one distinct rid per prompt is required")
        return [self.group(ids, p, return_logprob, top_logprobs_num, rid=rids[i] if rids else None,
                           bootstrap=bootstrap[i] if bootstrap is not None else None,
                           logprob_start_len=logprob_start_len)
                for i, (ids, p) in enumerate(zip(prompts, params))]

    def group(self, ids: Sequence[int], p: SamplingParams, return_logprob: bool, top_logprobs_num: int,
              rid: str | None = None, bootstrap: tuple[Bootstrap, ...] | None = None,
              logprob_start_len: int = -1) -> NewRequest:
        """The message for the n samples of one prompt (samples 2..n are forked from the
        first after prefill); unchecked: `build` is the validating entry point."""
        base = p.seed if p.seed is not None else self._rng.getrandbits(63)
        return NewRequest(rid=rid or uuid.uuid4().hex, prompt_ids=tuple(ids), params=p,
                          seeds=tuple(sample_seed(base, j) for j in range(p.n)),
                          return_logprob=return_logprob or top_logprobs_num > 0,
                          top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len,
                          bootstrap=bootstrap)


def check_new_tokens(max_new_tokens: int, min_new_tokens: int, names: ApiFields) -> None:
    """The token budget in the caller's names, for APIs whose fields SamplingParams does
    not spell (it checks the same bounds under its own names for everyone else)."""
    if not 0 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"{names.max_new_tokens}: must be in [0, 2^20], got {max_new_tokens!r}")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"{names.min_new_tokens}: must be in [0, {names.max_new_tokens}], "
                         f"got {min_new_tokens!r}")


def bootstrap_addresses(mode: str, default_port: int, host: Any, port: Any, room: Any,
                        counts: list[int]) -> list[tuple[Bootstrap, ...]] | None:
    """Per prompt, per sample, the prefill server a sample meets its other half through;
    None when colocated (`mode` "null": the fields are ignored, as SGLang does).
    `counts`: the n of each prompt. Lists carry one value per sample, prompt-major
    (prompt i's sample j at sum(n of prompts < i) + j), as SGLang's router sends them;
    scalars apply to all samples (a room only when there is a single sample)."""
    if mode == "null":
        return None
    if room is None or host is None:
        raise ValueError(f"bootstrap_room: a {mode} server needs bootstrap_host and "
                         "bootstrap_room (send requests through a PD router)")
    total = sum(counts)

    def per_sample(value: Any, name: str) -> list[Any]:
        if not isinstance(value, list):
            return [value] * total
        if len(value) == total:
            return value
        raise ValueError(f"{name}: {len(value)} values for {total} samples ({len(counts)} prompts x n); "
                         "give one per sample")
    hosts = per_sample(host, "bootstrap_host")
    ports = per_sample(port, "bootstrap_port")
    rooms = per_sample(room, "bootstrap_room")
    if total > 1 and not isinstance(room, list):
        raise ValueError(f"bootstrap_room: {total} samples need one room each (a list)")
    if len(set(rooms)) != len(rooms):
        raise ValueError("bootstrap_room: every sample needs a distinct room")
    flat = []
    for h, p, r in zip(hosts, ports, rooms):
        if not isinstance(r, int) or not 0 <= r < 2**63:
            raise ValueError(f"bootstrap_room: must be in [0, 2^63), got {r}")
        p = p if p is not None else default_port
        if not 0 < p <= 65535:
            raise ValueError(f"bootstrap_port: must be in [1, 65535], got {p}")
        flat.append(Bootstrap(h, p, r))
    out, at = [], 0
    for c in counts:
        out.append(tuple(flat[at: at + c]))
        at += c
    return out
