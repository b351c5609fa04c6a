"""From user input to scheduler requests: validation and sample groups.

Shared by the offline Engine and the HTTP server, so both refuse the same
inputs with the same messages (each names the offending field).
"""

from __future__ import annotations

import random
import uuid
from typing import Any, Sequence

from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.req import Req


def sample_seed(base: int, index: int) -> int:
    """Seed of sample `index` of a request whose first sample uses `base`."""
    if index == 0:
        return base
    return random.Random(f"{base}:{index}").getrandbits(63)


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
                check_text(t, prompt_field)
            ids = [self.tokenizer(t)["input_ids"] for t in texts]
        else:
            if not isinstance(input_ids, (list, tuple)) or not input_ids:
                raise ValueError(f"{ids_field}: must be a non-empty list of token ids or of lists")
            single = not isinstance(input_ids[0], (list, tuple))
            ids = [list(input_ids)] if single else [list(x) for x in input_ids]
            for seq in ids:
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
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * n_prompts
        for p in params:
            if p.n > self.max_n:
                raise ValueError(f"n: {p.n} is above the limit {self.max_n} (--max-n)")
        return params

    def check_lengths(self, ids: list[int], p: SamplingParams, max_tokens_field: str = "max_new_tokens"
                      ) -> None:
        if len(ids) >= self.context_len:
            raise ValueError(f"prompt: {len(ids)} tokens do not fit the context length {self.context_len}")
        if len(ids) + p.max_new_tokens > self.context_len:
            raise ValueError(f"{max_tokens_field}: prompt ({len(ids)} tokens) + {max_tokens_field} "
                             f"({p.max_new_tokens}) exceeds the context length {self.context_len}")

    @staticmethod
    def check_logprob_args(return_logprob: Any, top_logprobs_num: Any) -> None:
        if not isinstance(return_logprob, bool):
            raise ValueError("return_logprob: must be a boolean")
        if not isinstance(top_logprobs_num, int) or isinstance(top_logprobs_num, bool) \
                or not 0 <= top_logprobs_num <= 20:
            raise ValueError(f"top_logprobs_num: must be an integer in [0, 20], got {top_logprobs_num!r}")

    def group(self, ids: list[int], p: SamplingParams, return_logprob: bool, top_logprobs_num: int,
              rid: str | None = None) -> list[Req]:
        """The n samples of one prompt; samples 2..n are forked from the first after prefill."""
        rid = rid or uuid.uuid4().hex
        base = p.seed if p.seed is not None else self._rng.getrandbits(63)
        samples = [Req(rid=rid, prompt_ids=list(ids), params=p, seed=sample_seed(base, j),
                       return_logprob=return_logprob or top_logprobs_num > 0,
                       top_logprobs_num=top_logprobs_num, sample_index=j) for j in range(p.n)]
        samples[0].pending_forks = samples[1:]
        return samples


def as_list(x: Sequence[Any] | Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]
