"""Per-request sampling parameters, named as in SGLang's `sampling_params`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, Mapping

MAX_NEW_TOKENS = 1 << 20  # the largest max_new_tokens any API accepts
# Per request (issue 39): the scheduler looks for stop strings in the decoded tail of every
# output at every step (as many tokens as the longest stop string has characters) and the
# detokenizer keeps what could begin one, so their length bounds that work; stop token ids
# are looked up per row and step.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    # Constrained decoding (SGLang's names; at most one): a JSON schema (as JSON text),
    # a regular expression, or an EBNF grammar the output must match.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        # Accept a single stop string / lists, store tuples (hashable, immutable).
        # Anything else (an int, a dict) is left as given for _validate to refuse.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """`stop_token_ids` as a set, built once per request (it is looked up per token)."""
        return frozenset(self.stop_token_ids)

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field name, grammar text) of the constraint on the output, if any."""
        for name in CONSTRAINT_FIELDS:
            text = getattr(self, name)
            if text is not None:
                return name, text
        return None

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> "SamplingParams":
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, Mapping):
            raise ValueError(f"sampling_params: expected a dict, got {type(params).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {', '.join(unknown)}")
        # None means "default" for every field (JSON clients send explicit nulls).
        return cls(**{k: v for k, v in params.items() if v is not None or k == "seed"})

    def _validate(self) -> None:
        def need(cond: bool, name: str, why: str) -> None:
            if not cond:
                raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            need(is_int(getattr(self, name)), name, "must be an integer")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            need(is_num(getattr(self, name)), name, "must be a number")
        need(0 <= self.max_new_tokens <= MAX_NEW_TOKENS, "max_new_tokens", "must be in [0, 2^20]")
        need(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
             "must be in [0, max_new_tokens]")
        need(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        need(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (disabled) or >= 1")
        need(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        need(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        need(self.n >= 1, "n", "must be >= 1")
        need(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
             "must be an integer in [0, 2^63)")
        need(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop), "stop",
             "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: {len(self.stop)} stop strings, at most {MAX_STOP_STRINGS}")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"stop: a stop string of {longest} characters, at most {MAX_STOP_CHARS}")
        # Counted before the ids are looked at: a million of them is refused at once.
        if isinstance(self.stop_token_ids, tuple) and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: {len(self.stop_token_ids)} ids, at most {MAX_STOP_TOKEN_IDS}")
        need(isinstance(self.stop_token_ids, tuple) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids", "must be a list of non-negative integers")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            need(isinstance(getattr(self, name), bool), name, "must be a boolean")
        for name in CONSTRAINT_FIELDS:
            need(getattr(self, name) is None or isinstance(getattr(self, name), str), name, "must be a string")
        chosen = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise ValueError(f"{', '.join(chosen)}: at most one of json_schema, regex and ebnf may be set")
        # The grammar decides where a constrained output may end; a floor that bans the
        # end tokens could leave no token the grammar allows.
        need(not chosen or self.min_new_tokens == 0, "min_new_tokens",
             f"must be 0 when {chosen[0] if chosen else ''} constrains the output")
