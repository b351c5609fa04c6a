"""The request: everything the scheduler tracks for one sample of one prompt."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.messages import NewRequest


class FinishKind(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class FinishReason:
    kind: FinishKind
    matched: int | str | None = None  # stop token id or stop string
    message: str | None = None        # why an abort happened
    server_error: bool = False        # an abort the server caused (a failed transfer), not the input

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind.value}
        if self.kind is FinishKind.STOP:
            out["matched"] = self.matched
        elif self.kind is FinishKind.ABORT:
            out["message"] = self.message
            if self.server_error:
                out["server_error"] = True
        return out


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    return_logprob: bool = False
    top_logprobs_num: int = 0
    sample_index: int = 0          # which of the request's n samples this is
    # Samples still to be forked from this one once its prompt is in the KV pool.
    pending_forks: list["Req"] = field(default_factory=list)

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # Prompt logprobs (see scheduler/prompt_logprobs.py): -1 none; else one entry per prompt
    # token from this position on, the first prompt token's None. Filled chunk by chunk
    # during prefill; the samples of one prompt share the lists (computed once).
    logprob_start_len: int = -1
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None

    # KV state
    row: int | None = None         # request-table row while the request holds KV
    kv_len: int = 0                # positions whose KV is in the pool
    cached_tokens: int = 0         # prompt tokens served from the prefix cache
    lock_node: Any = None          # radix node locked while the request runs
    retractions: int = 0

    finish: FinishReason | None = None
    # Constrained decoding: where the output is in its grammar (scheduler.grammar.GrammarState)
    grammar: Any = None

    # Disaggregation: where the other half of this request lives (None: colocated)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None

    # Speculative decoding
    draft_len: int = 0             # positions whose draft KV is written (<= kv_len)
    spec_verify_ct: int = 0        # verify rounds this request took part in
    spec_accepted_drafts: int = 0  # draft tokens it accepted

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV the request needs before it can draw its next token."""
        return self.prompt_ids + self.output_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def fill_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def remaining_new_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)


def samples_from_message(msg: NewRequest) -> list[Req]:
    """The scheduler's requests for one `NewRequest`: sample 0 carries samples 1..n-1 in
    `pending_forks` (they are forked from it once its prompt is in the KV pool)."""
    samples = []
    for j, seed in enumerate(msg.seeds):
        where = msg.bootstrap[j] if msg.bootstrap is not None else None
        samples.append(Req(rid=msg.rid, prompt_ids=list(msg.prompt_ids), params=msg.params, seed=seed,
                           return_logprob=msg.return_logprob, top_logprobs_num=msg.top_logprobs_num,
                           logprob_start_len=msg.logprob_start_len, sample_index=j,
                           bootstrap_host=where.host if where else None,
                           bootstrap_port=where.port if where else None,
                           bootstrap_room=where.room if where else None))
    samples[0].pending_forks = samples[1:]
    return samples


def stop_reason(req: Req, eos_ids: tuple[int, ...], context_len: int,
                decode_text: Callable[[list[int]], str]) -> FinishReason | None:
    """Why ``req`` stops after its last output token (None: it goes on). Stop strings
    are looked for in the decoded tail that could hold the longest of them."""
    p = req.params
    token = req.output_ids[-1]
    n_out = len(req.output_ids)
    if n_out >= p.min_new_tokens:
        if not p.ignore_eos and token in eos_ids:
            return FinishReason(FinishKind.STOP, matched=token)
        if token in p.stop_token_set:  # built once per request, not per step
            return FinishReason(FinishKind.STOP, matched=token)
        if p.stop:
            longest = max(len(s) for s in p.stop)
            tail = decode_text(req.output_ids[-(longest + 1):])
            for s in p.stop:
                if s in tail:
                    return FinishReason(FinishKind.STOP, matched=s)
    if n_out >= p.max_new_tokens or req.fill_len >= context_len:
        return FinishReason(FinishKind.LENGTH)
    return None
