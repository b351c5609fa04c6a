"""Batched sampling on the device: penalties, temperature, top-k / top-p / min-p, seeded draws.

Randomness is a pure function of (request seed, output position, token id):
a hash turned into Gumbel noise. So a request with a seed gives the same
output whatever it is batched with, and a retracted request that recomputes
its KV draws exactly what it would have drawn. The (seed, position) part is
mixed once per row on the host (``row_key``); only a short hash of (row key,
token id) runs over the vocabulary.

``make_sampling_info`` plans a batch from Python values (no device read) and
uploads its per-row parameters; ``sample`` then runs without reading the device.

Filtering has one definition whatever path a batch takes: a row's tokens are
ranked by log-probability, ties by token id (lowest first); top-k keeps the
first k, top-p keeps a token while the mass ranked before it is <= top_p, min-p
keeps log p >= max log p + log(min_p), and the first token always survives. A
row with top-k or top-p draws over its ranked candidates: ``torch.topk`` of the
largest top-k in the batch when every such row's top-k is at most
``CANDIDATE_CAP``, else a sort of the whole vocabulary; both give the same
tokens. Other rows draw over the whole vocabulary with no ranking at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

import torch

from pdserve.model.device_io import upload

CANDIDATE_CAP = 1024  # largest top-k served by a partial selection instead of a full sort

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B     # < 2^27: products with 32-bit values stay inside int64
_WEYL = 0x9E3779B9    # odd: token ids map to distinct 32-bit hash inputs
_H1 = 0x7FEB352D      # multipliers of the per-token hash, < 2^31 (no int64 overflow)
_H2 = 0x2C1B3C6D

Int = TypeVar("Int", int, torch.Tensor)


def _mix32(x: Int) -> Int:
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    return (x >> 16) ^ x


def row_key(seed: Int, step: Int) -> Int:
    """32-bit key of (seed in [0, 2^63), output position): the same on Python ints
    (how ``make_sampling_info`` gets it) and on int64 tensors."""
    h = _mix32(step & _MASK32)
    h = _mix32(h ^ (seed & _MASK32))
    return _mix32(h ^ (seed >> 32) ^ 0x9E3779B9)


def _hash_uniform(keys: torch.Tensor, token_ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """float32 uniforms (v + 0.5) / 2^23, never 0 or 1, for a 23-bit hash v of (row
    key, token id): keys [R]; token_ids [R, K], or None for the whole vocabulary
    [R, vocab]. The token id's Weyl step xor the key, then two multiply-xorshift
    rounds (one leaves neighbouring tokens correlated); v is bits 9..31 of the
    last product, kept in place so that v * 2^9 + 2^8 converts exactly. Nine
    [R, K] integer passes, the conversion and two float passes."""
    if token_ids is None:
        weyl = torch.arange(vocab, dtype=torch.int64, device=keys.device).mul_(_WEYL).bitwise_and_(_MASK32)
        x = weyl.unsqueeze(0) ^ keys.unsqueeze(1)
    else:
        x = (token_ids * _WEYL).bitwise_and_(_MASK32).bitwise_xor_(keys.unsqueeze(1))
    t = x >> 16
    x.bitwise_xor_(t).mul_(_H1).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 15, out=t)
    x.bitwise_xor_(t).mul_(_H2).bitwise_and_(0xFFFFFE00)
    return x.float().add_(256.0).mul_(2.0 ** -32)


def _hash_gumbel(keys: torch.Tensor, token_ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """float32 Gumbel noise -log(-log u) of the same uniforms (finite: u is never 0 or 1)."""
    return _hash_uniform(keys, token_ids, vocab).log_().neg_().log_().neg_()


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] float32 uniforms in (0, 1), deterministic in (seed, step, token id)."""
    return _hash_uniform(row_key(seeds, steps), None, vocab)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] float32 Gumbel(0, 1) noise, deterministic in (seed, step, token id)."""
    return _hash_gumbel(row_key(seeds, steps), None, vocab)


@dataclass
class Penalties:
    repetition: torch.Tensor   # [R, 1]
    frequency: torch.Tensor    # [R, 1]
    presence: torch.Tensor     # [R, 1]
    output_counts: torch.Tensor  # [R, V] occurrences in the output so far
    seen: torch.Tensor         # [R, V] bool: in the prompt or the output


@dataclass
class SamplingInfo:
    """One batch's sampling inputs on the device, and the plan made for it on the host."""
    temperatures: torch.Tensor  # [R] float32 (0 = greedy)
    top_ps: torch.Tensor        # [R] float32
    top_ks: torch.Tensor        # [R] int64, vocab size when disabled
    min_ps: torch.Tensor        # [R] float32
    keys: torch.Tensor          # [R] int64: row_key(seed, index of the token being drawn)
    all_greedy: bool
    # Sampled rows with top-k or top-p draw over ranked candidates: how many per
    # row (0: no such row; vocab: a full sort). The others draw over the whole
    # vocabulary. With both kinds in the batch, the device row indices of each.
    candidates: int = 0
    ranked_rows: torch.Tensor | None = None
    free_rows: torch.Tensor | None = None
    # Whether some sampled row uses each filter (the others' passes are skipped).
    use_top_k: bool = True
    use_top_p: bool = True
    use_min_p: bool = True
    penalties: Penalties | None = None
    banned: torch.Tensor | None = None  # [R, V] bool: tokens not allowed yet (min_new_tokens)
    allowed: torch.Tensor | None = None  # [R, ceil(V / 32)] int32 bits: what each row's grammar allows


@dataclass
class SampleOutput:
    next_ids: torch.Tensor               # [R] int64
    logprobs: torch.Tensor | None        # [R] logprob of the chosen token
    top_logprobs: torch.Tensor | None    # [R, K]
    top_ids: torch.Tensor | None         # [R, K]


def make_sampling_info(temperatures: Sequence[float], top_ps: Sequence[float], top_ks: Sequence[int],
                       min_ps: Sequence[float], keys: Sequence[int], vocab: int,
                       device: torch.device) -> SamplingInfo:
    """Plan a batch from per-row Python values (top_k <= 0 or >= vocab: disabled;
    temperature 0 or top_k 1: greedy) and upload them: one float32 and one int64
    transfer, O(rows) host work, no device read."""
    n = len(temperatures)
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    temps = [0.0 if k == 1 else float(t) for t, k in zip(temperatures, ks)]
    sampled = [i for i in range(n) if temps[i] > 0]
    ranked = [i for i in sampled if ks[i] < vocab or top_ps[i] < 1]
    free = [i for i in sampled if ks[i] >= vocab and top_ps[i] >= 1]
    k_max = max((ks[i] for i in ranked), default=0)
    candidates = 0 if not ranked else k_max if k_max <= CANDIDATE_CAP else vocab
    mixed = bool(ranked) and bool(free)
    floats = upload([*temps, *top_ps, *min_ps], torch.float32, device).view(3, n)
    ints = upload([*ks, *keys, *(ranked + free if mixed else [])], torch.int64, device)
    return SamplingInfo(
        temperatures=floats[0], top_ps=floats[1], min_ps=floats[2],
        top_ks=ints[:n], keys=ints[n:2 * n],
        all_greedy=not sampled, candidates=candidates,
        ranked_rows=ints[2 * n: 2 * n + len(ranked)] if mixed else None,
        free_rows=ints[2 * n + len(ranked):] if mixed else None,
        use_top_k=any(ks[i] < vocab for i in ranked), use_top_p=any(top_ps[i] < 1 for i in ranked),
        use_min_p=any(min_ps[i] > 0 for i in sampled),
    )


class PenaltyRows:
    """Per-request penalty state on the device: one row per slot of output-token
    counts [V] and seen marks [V] (prompt or output). Slot 0 stays all zero (rows
    without penalties). Callers own the slot numbering (``pdserve.scheduler.batch``)."""

    def __init__(self, vocab: int, device: torch.device, capacity: int = 16) -> None:
        self.vocab = vocab
        self.counts = torch.zeros(capacity, vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(capacity, vocab, dtype=torch.bool, device=device)

    @property
    def capacity(self) -> int:
        return self.counts.shape[0]

    def grow(self, capacity: int) -> None:
        more = capacity - self.capacity
        if more > 0:
            self.counts = torch.cat([self.counts, self.counts.new_zeros(more, self.vocab)])
            self.seen = torch.cat([self.seen, self.seen.new_zeros(more, self.vocab)])

    def update(self, reset: torch.Tensor | None, marks: torch.Tensor | None, counted: torch.Tensor | None
               ) -> None:
        """Zero the ``reset`` slots, then mark ``marks`` seen and count ``counted``
        (flat indices slot * V + token, repeats add up)."""
        if reset is not None:
            self.counts.index_fill_(0, reset, 0.0)
            self.seen.index_fill_(0, reset, False)
        if marks is not None:
            self.seen.view(-1).index_fill_(0, marks, True)
        if counted is not None:
            _count(self.counts, self.seen, counted)

    def gather(self, slots: torch.Tensor, extra: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, V] counts and seen marks of ``slots``, plus ``extra`` tokens (flat
        indices row * V + token) counted for this batch only."""
        counts, seen = self.counts.index_select(0, slots), self.seen.index_select(0, slots)
        if extra is not None:
            _count(counts, seen, extra)
        return counts, seen


def _count(counts: torch.Tensor, seen: torch.Tensor, flat: torch.Tensor) -> None:
    counts.view(-1).index_add_(0, flat, torch.ones(flat.shape[0], dtype=counts.dtype, device=counts.device))
    seen.view(-1).index_fill_(0, flat, True)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    rep = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
    logits = torch.where(p.seen, rep, logits)
    return logits - p.frequency * p.output_counts - p.presence * (p.output_counts > 0)


def _rank(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` tokens of each row by log-probability, ties by lowest id, as
    (log-probs, ids), each [R, k]. The whole vocabulary: a stable sort. Fewer: topk
    of one int64 key per token (the negated log-prob's float bits, which sort as
    integers for values >= +0, then the id), so ties cannot depend on the selection
    and the result is exactly a prefix of the stable sort."""
    vocab = logp.shape[-1]
    if k >= vocab:
        return logp.sort(dim=-1, descending=True, stable=True)
    bits = (0.0 - logp).clamp_(min=0.0).view(torch.int32).to(torch.int64)  # (-0.0 and +0.0: one key)
    key = bits.mul_(1 << 32).add_(torch.arange(vocab, device=logp.device))
    ids = key.topk(k, dim=-1, largest=False).values.bitwise_and_(_MASK32)
    return logp.gather(1, ids), ids


def _drop_ranked(vals: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None,
                 min_ps: torch.Tensor | None) -> torch.Tensor:
    """[R, K] bool: which ranked candidates (log-probs ``vals``, best first) the
    filters given drop; the first always survives."""
    drop = torch.zeros_like(vals, dtype=torch.bool)
    if top_ks is not None:
        drop |= torch.arange(vals.shape[-1], device=vals.device).unsqueeze(0) >= top_ks.unsqueeze(1)
    if top_ps is not None:
        p = vals.exp()
        mass_before = p.cumsum(-1).sub_(p)
        drop |= (mass_before > top_ps.unsqueeze(1)) & (top_ps < 1).unsqueeze(1)
    if min_ps is not None:
        drop |= vals < vals[:, :1] + min_ps.log().unsqueeze(1)
    drop[:, 0] = False
    return drop


def filter_probs(probs: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
    """``probs`` with the tokens top-k, top-p and min-p exclude set to zero (at least
    one survives): the rule ``sample`` applies, shown on a whole-vocabulary sort."""
    vals, ids = _rank(probs.log(), probs.shape[-1])
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter_(
        1, ids, _drop_ranked(vals, info.top_ks, info.top_ps, info.min_ps))
    return probs.masked_fill(drop, 0.0)


def _draw_ranked(logp: torch.Tensor, keys: torch.Tensor, top_ks: torch.Tensor | None,
                 top_ps: torch.Tensor | None, min_ps: torch.Tensor | None, candidates: int) -> torch.Tensor:
    vals, ids = _rank(logp, candidates)
    scores = vals.masked_fill_(_drop_ranked(vals, top_ks, top_ps, min_ps), float("-inf"))
    scores.add_(_hash_gumbel(keys, ids, logp.shape[-1]))
    return ids.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)


def _draw_free(logp: torch.Tensor, keys: torch.Tensor, min_ps: torch.Tensor | None) -> torch.Tensor:
    scores = _hash_gumbel(keys, None, logp.shape[-1]).add_(logp)
    if min_ps is not None:
        floor = logp.amax(dim=-1, keepdim=True) + min_ps.log().unsqueeze(1)
        scores.masked_fill_(logp < floor, float("-inf"))
    return scores.argmax(dim=-1)


def unpack_bits(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] bool from packed int32 words (token t is bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return (bits.unsqueeze(-1).bitwise_right_shift(shifts) & 1).bool().flatten(1)[:, :vocab]


def sample(logits: torch.Tensor, info: SamplingInfo, want_logprobs: bool, top_k_logprobs: int
           ) -> SampleOutput:
    """logits: [R, V] float32, raw model output for each row to sample. Greedy rows
    take the argmax after penalties and bans; logprobs are the raw logits' log-softmax.
    Reads nothing back from the device."""
    logprobs_all = torch.log_softmax(logits, dim=-1) if want_logprobs or top_k_logprobs else None
    work = logits
    if info.penalties is not None:
        work = apply_penalties(work, info.penalties)
    if info.banned is not None:
        work = work.masked_fill(info.banned, float("-inf"))
    if info.allowed is not None:
        work = work.masked_fill(~unpack_bits(info.allowed, work.shape[-1]), float("-inf"))
    greedy_ids = work.argmax(dim=-1)
    if info.all_greedy:
        next_ids = greedy_ids
    else:
        temps = info.temperatures.clamp(min=1e-5).unsqueeze(1)
        logp = torch.log_softmax(work / temps, dim=-1)
        keys, min_ps = info.keys, info.min_ps if info.use_min_p else None
        top_ks, top_ps = info.top_ks if info.use_top_k else None, info.top_ps if info.use_top_p else None
        if info.ranked_rows is not None and info.free_rows is not None:  # both kinds: each on its rows
            sampled = torch.empty_like(greedy_ids)
            r, f = info.ranked_rows, info.free_rows
            sampled[r] = _draw_ranked(logp[r], keys[r], *(None if a is None else a[r] for a in
                                                          (top_ks, top_ps, min_ps)), info.candidates)
            sampled[f] = _draw_free(logp[f], keys[f], None if min_ps is None else min_ps[f])
        elif info.candidates:
            sampled = _draw_ranked(logp, keys, top_ks, top_ps, min_ps, info.candidates)
        else:
            sampled = _draw_free(logp, keys, min_ps)
        next_ids = torch.where(info.temperatures == 0, greedy_ids, sampled)
    chosen_lp = top_lp = top_ids = None
    if logprobs_all is not None:
        chosen_lp = logprobs_all.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        if top_k_logprobs:
            top_lp, top_ids = logprobs_all.topk(top_k_logprobs, dim=-1)
    return SampleOutput(next_ids, chosen_lp, top_lp, top_ids)
