"""Typed messages between the server's processes (all sent with ipc.dumps).

HTTP -> scheduler: `pdserve.scheduler.messages.Command` (new requests as `NewRequest`s).
scheduler -> detokenizer: `TokenBatch` of `TokenUpdate`s (new tokens since the last one).
detokenizer -> HTTP: `TextBatch` of `TextUpdate`s (the same plus the new text).
scheduler -> HTTP: `Reply` to a query (state, flush).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenUpdate:
    rid: str
    index: int                      # sample index within the request
    new_ids: tuple[int, ...]
    new_logprobs: tuple[float, ...]
    new_top_logprobs: tuple[tuple[tuple[float, int], ...], ...]
    finish: dict[str, Any] | None   # FinishReason.to_dict() once finished
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    retractions: int
    spec_verify_ct: int             # speculative verify rounds so far (0 without speculation)
    spec_accepted_drafts: int
    params: SamplingParams | None   # first update of a sample only (detokenizer needs it)
    # Prompt logprobs (logprob_start_len >= 0), first update of a sample only: from that
    # prompt position on, the first prompt token's None; None when not computed here.
    input_logprobs: tuple[float | None, ...] | None = None
    input_top_logprobs: tuple[tuple[tuple[float, int], ...] | None, ...] | None = None


@dataclass(frozen=True)
class TokenBatch:
    updates: tuple[TokenUpdate, ...]


@dataclass(frozen=True)
class TextUpdate:
    token: TokenUpdate
    text_delta: str


@dataclass(frozen=True)
class TextBatch:
    updates: tuple[TextUpdate, ...]


@dataclass(frozen=True)
class Reply:
    kind: str
    payload: Any
