"""What one scheduler step runs and what it produced: the batch, the sampler's
batched inputs built from requests, the drawn tokens, the step's output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ForwardInput
from pdserve.model.sampler import Penalties, SamplingInfo, sample
from pdserve.scheduler.req import Req


class Drawable(Protocol):
    """What the sampler reads of a request (a Req, or a view of one mid-round)."""
    params: Any
    seed: int
    num_output_tokens: int

    @property
    def output_ids(self) -> list[int]: ...

    @property
    def fill_ids(self) -> list[int]: ...


@dataclass
class StepOutput:
    advanced: list[Req] = field(default_factory=list)  # drew a token this step
    finished: list[Req] = field(default_factory=list)  # finished this step (incl. aborts)


@dataclass
class ScheduledBatch:
    """What the scheduler decided to run this step."""
    mode: str                   # prefill | decode | verify (a speculative round)
    reqs: list[Req]             # rows of the forward, in order
    forward: ForwardInput
    # Requests that draw a token this step, and which logits row each uses.
    sampling_reqs: list[Req] = field(default_factory=list)
    sampling_rows: list[int] = field(default_factory=list)
    tree: Any = None            # verify: the draft tree (speculative.eagle_worker.DraftTree)


@dataclass(frozen=True)
class Draws:
    """Tokens drawn for a list of rows, with their logprobs when asked, as host lists."""
    ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[float]] | None
    top_ids: list[list[int]] | None

    def append_to(self, req: Req, i: int) -> None:
        """Emit row ``i``'s token as ``req``'s next output token."""
        req.output_ids.append(self.ids[i])
        if req.return_logprob and self.logprobs is not None:
            req.output_logprobs.append(self.logprobs[i])
            if req.top_logprobs_num and self.top_logprobs is not None and self.top_ids is not None:
                k = req.top_logprobs_num
                req.output_top_logprobs.append(list(zip(self.top_logprobs[i][:k], self.top_ids[i][:k])))


def draw(logits: torch.Tensor, rows: Sequence[Drawable], owners: Sequence[Req], vocab_size: int,
         eos_ids: tuple[int, ...], tp: TPGroup) -> Draws:
    """Sample one token per logits row; ``rows`` say what each row's request looks like
    at that position, ``owners`` which requests ask for logprobs. Rank 0's draw is
    broadcast so every TP rank emits the same token."""
    info = build_sampling_info(rows, vocab_size, eos_ids, logits.device)
    want_lp = any(r.return_logprob for r in owners)
    top_k = max((r.top_logprobs_num for r in owners), default=0)
    result = sample(logits, info, want_lp, top_k)
    return Draws(tp.broadcast(result.next_ids).tolist(),
                 result.logprobs.tolist() if result.logprobs is not None else None,
                 result.top_logprobs.tolist() if result.top_logprobs is not None else None,
                 result.top_ids.tolist() if result.top_ids is not None else None)


def build_sampling_info(reqs: Sequence[Drawable], vocab_size: int, eos_ids: tuple[int, ...],
                        device: torch.device) -> SamplingInfo:
    ps = [r.params for r in reqs]
    temps = torch.tensor([p.temperature for p in ps], dtype=torch.float32)
    all_greedy = bool((temps == 0).all()) or all(p.greedy for p in ps)
    top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in ps], dtype=torch.int64)
    top_ps = torch.tensor([p.top_p for p in ps], dtype=torch.float32)
    min_ps = torch.tensor([p.min_p for p in ps], dtype=torch.float32)
    # top_k == 1 is greedy whatever the temperature.
    temps = torch.where(top_ks == 1, torch.zeros_like(temps), temps)
    need_filter = bool((top_ks < vocab_size).any() | (top_ps < 1).any() | (min_ps > 0).any())
    info = SamplingInfo(
        temperatures=temps.to(device),
        top_ps=top_ps.to(device),
        top_ks=top_ks.to(device),
        min_ps=min_ps.to(device),
        seeds=torch.tensor([r.seed for r in reqs], dtype=torch.int64, device=device),
        steps=torch.tensor([r.num_output_tokens for r in reqs], dtype=torch.int64, device=device),
        all_greedy=all_greedy,
        need_filter=need_filter,
    )
    if any(p.needs_penalties for p in ps):
        info.penalties = _penalties(reqs, vocab_size, device)
    banned_rows = [i for i, r in enumerate(reqs) if r.num_output_tokens < r.params.min_new_tokens]
    if banned_rows:
        banned = torch.zeros(len(reqs), vocab_size, dtype=torch.bool)
        for i in banned_rows:
            r = reqs[i]
            ids = set(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                ids.update(eos_ids)
            ids = [t for t in ids if t < vocab_size]
            if ids:
                banned[i, ids] = True
        info.banned = banned.to(device)
    return info


def _penalties(reqs: Sequence[Drawable], vocab_size: int, device: torch.device) -> Penalties:
    n = len(reqs)
    counts = torch.zeros(n, vocab_size, dtype=torch.float32)
    seen = torch.zeros(n, vocab_size, dtype=torch.bool)
    for i, r in enumerate(reqs):
        if r.output_ids:
            out = torch.tensor(r.output_ids, dtype=torch.int64)
            counts[i].index_add_(0, out, torch.ones(len(out)))
        seen[i, torch.tensor(r.fill_ids, dtype=torch.int64)] = True

    def col(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return Penalties(
        repetition=col([r.params.repetition_penalty for r in reqs]),
        frequency=col([r.params.frequency_penalty for r in reqs]),
        presence=col([r.params.presence_penalty for r in reqs]),
        output_counts=counts.to(device),
        seen=seen.to(device),
    )
