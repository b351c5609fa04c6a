"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded draws.

Randomness is a pure function of (request seed, output position, token id):
a hash turned into Gumbel noise. So a request with a seed gives the same
output whatever it is batched with, and a retracted request that recomputes
its KV draws exactly what it would have drawn. No per-request Python loop and
no generator state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # < 2^27: products with 32-bit values stay inside int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] uniforms in (0, 1), deterministic in (seed, step, token id)."""
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64).unsqueeze(0)
    lo = (seeds & _MASK32).unsqueeze(1)
    hi = ((seeds >> 32) & _MASK32).unsqueeze(1)
    h = _mix32(token ^ _mix32(steps.unsqueeze(1) & _MASK32))
    h = _mix32(h ^ lo)
    h = _mix32(h ^ hi ^ 0x9E3779B9)
    return (h.double() + 0.5) / 4294967296.0


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    u = uniform_noise(seeds, steps, vocab)
    return (-torch.log(-torch.log(u))).float()


@dataclass
class Penalties:
    repetition: torch.Tensor   # [R, 1]
    frequency: torch.Tensor    # [R, 1]
    presence: torch.Tensor     # [R, 1]
    output_counts: torch.Tensor  # [R, V] occurrences in the output so far
    seen: torch.Tensor         # [R, V] bool: in the prompt or the output


@dataclass
class SamplingInfo:
    temperatures: torch.Tensor  # [R] (0 = greedy)
    top_ps: torch.Tensor        # [R]
    top_ks: torch.Tensor        # [R] int64, vocab size when disabled
    min_ps: torch.Tensor        # [R]
    seeds: torch.Tensor         # [R] int64
    steps: torch.Tensor         # [R] int64: index of the token being drawn in the output
    all_greedy: bool
    need_filter: bool           # any top-k / top-p / min-p in use
    penalties: Penalties | None = None
    banned: torch.Tensor | None = None  # [R, V] bool: tokens not allowed yet (min_new_tokens)


@dataclass
class SampleOutput:
    next_ids: torch.Tensor               # [R] int64
    logprobs: torch.Tensor | None        # [R] logprob of the chosen token
    top_logprobs: torch.Tensor | None    # [R, K]
    top_ids: torch.Tensor | None         # [R, K]


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    rep = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
    logits = torch.where(p.seen, rep, logits)
    return logits - p.frequency * p.output_counts - p.presence * (p.output_counts > 0)


def filter_probs(probs: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
    """Zero out tokens excluded by top-k, top-p and min-p (at least one survives)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    drop = rank >= info.top_ks.unsqueeze(1)
    cum_before = sorted_p.cumsum(-1) - sorted_p
    drop |= cum_before > info.top_ps.unsqueeze(1)
    drop |= sorted_p < info.min_ps.unsqueeze(1) * sorted_p[:, :1]
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def sample(logits: torch.Tensor, info: SamplingInfo, want_logprobs: bool, top_k_logprobs: int
           ) -> SampleOutput:
    """logits: [R, V] float32, raw model output for each row to sample."""
    logprobs_all = torch.log_softmax(logits, dim=-1) if want_logprobs or top_k_logprobs else None
    work = logits
    if info.penalties is not None:
        work = apply_penalties(work, info.penalties)
    if info.banned is not None:
        work = work.masked_fill(info.banned, float("-inf"))
    greedy_ids = work.argmax(dim=-1)
    if info.all_greedy:
        next_ids = greedy_ids
    else:
        temps = info.temperatures.clamp(min=1e-5).unsqueeze(1)
        probs = torch.softmax(work / temps, dim=-1)
        if info.need_filter:
            probs = filter_probs(probs, info)
        # Gumbel-max over log-probs draws from the (renormalised) filtered distribution.
        scores = torch.log(probs) + gumbel_noise(info.seeds, info.steps, probs.shape[-1])
        sampled = scores.argmax(dim=-1)
        next_ids = torch.where(info.temperatures == 0, greedy_ids, sampled)
    chosen_lp = top_lp = top_ids = None
    if logprobs_all is not None:
        chosen_lp = logprobs_all.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        if top_k_logprobs:
            top_lp, top_ids = logprobs_all.topk(top_k_logprobs, dim=-1)
    return SampleOutput(next_ids, chosen_lp, top_lp, top_ids)
