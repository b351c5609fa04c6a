"""Turning a list of requests into the sampler's batched tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.model.runner import ForwardInput
from pdserve.model.sampler import Penalties, SamplingInfo
from pdserve.scheduler.req import Req


def build_sampling_info(reqs: list[Req], vocab_size: int, eos_ids: tuple[int, ...],
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


def _penalties(reqs: list[Req], vocab_size: int, device: torch.device) -> Penalties:
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


@dataclass
class ScheduledBatch:
    """What the scheduler decided to run this step."""
    mode: str                   # "prefill" | "decode"
    reqs: list[Req]             # rows of the forward, in order
    forward: ForwardInput
    # Requests that draw a token this step, and which logits row each uses.
    sampling_reqs: list[Req] = field(default_factory=list)
    sampling_rows: list[int] = field(default_factory=list)
