"""Sampler: hashed noise, greedy / seeded sampling, filters, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import device_io, sampler
from pdserve.model.parallel import TPGroup
from pdserve.model.sampler import (Penalties, SamplingInfo, apply_penalties, filter_probs, gumbel_noise,
                                   make_sampling_info, row_key, sample, uniform_noise)
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import batch as batch_mod
from pdserve.scheduler.req import FinishKind, FinishReason, Req
from pdserve.speculative.decoding import DrawView

pytestmark = pytest.mark.fast


def make_info(rows: int, vocab: int, *, temperature=1.0, top_p=1.0, top_k=None, min_p=0.0,
              seeds=None, steps=None, penalties=None, banned=None) -> SamplingInfo:
    def col(v):
        if isinstance(v, torch.Tensor):
            return v.tolist()
        if isinstance(v, (list, tuple)):
            return list(v)
        return [v] * rows

    seeds, steps = col(0 if seeds is None else seeds), col(0 if steps is None else steps)
    info = make_sampling_info(col(temperature), col(top_p), col(-1 if top_k is None else top_k), col(min_p),
                              [row_key(s, t) for s, t in zip(seeds, steps)], vocab, torch.device("cpu"))
    info.penalties, info.banned = penalties, banned
    return info


# ---- noise -------------------------------------------------------------------------------------
def test_uniform_noise_deterministic():
    seeds = torch.tensor([0, 1, 12345, 2**62 + 7])
    steps = torch.tensor([0, 3, 3, 100])
    a = uniform_noise(seeds, steps, 50)
    b = uniform_noise(seeds.clone(), steps.clone(), 50)
    assert a.shape == (4, 50)
    assert torch.equal(a, b)


def test_uniform_noise_row_independent_of_batch():
    seeds = torch.tensor([5, 6, 7])
    steps = torch.tensor([1, 2, 3])
    full = uniform_noise(seeds, steps, 32)
    alone = uniform_noise(seeds[1:2], steps[1:2], 32)
    assert torch.equal(full[1:2], alone)
    # a prefix of the vocabulary gives the same per-token values
    assert torch.equal(uniform_noise(seeds, steps, 8), full[:, :8])


def test_uniform_noise_differs_across_seeds_and_steps():
    base = uniform_noise(torch.tensor([7]), torch.tensor([0]), 64)
    other_seed = uniform_noise(torch.tensor([8]), torch.tensor([0]), 64)
    other_step = uniform_noise(torch.tensor([7]), torch.tensor([1]), 64)
    hi_seed = uniform_noise(torch.tensor([7 + 2**40]), torch.tensor([0]), 64)  # differs in high bits only
    for other in (other_seed, other_step, hi_seed):
        # essentially every value differs
        assert (base != other).float().mean() > 0.95
    # tokens within a row differ too
    assert base.unique().numel() > 60


def test_uniform_noise_range_and_uniformity():
    n_rows, vocab = 1000, 100
    seeds = torch.arange(n_rows, dtype=torch.int64) * 7919
    steps = torch.arange(n_rows, dtype=torch.int64) % 13
    u = uniform_noise(seeds, steps, vocab).flatten()
    assert u.numel() == 100_000
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.005  # std of the mean is ~0.0009
    assert abs(u.var().item() - 1 / 12) < 0.003
    hist = torch.histc(u.float(), bins=10, min=0.0, max=1.0) / u.numel()
    assert bool(((hist - 0.1).abs() < 0.005).all()), hist


def test_uniform_noise_same_seed_consecutive_steps_uniform():
    steps = torch.arange(2000, dtype=torch.int64)
    u = uniform_noise(torch.full((2000,), 42, dtype=torch.int64), steps, 50).flatten()
    assert abs(u.mean().item() - 0.5) < 0.005


def test_gumbel_noise_finite():
    g = gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 257)
    assert g.dtype == torch.float32
    assert bool(torch.isfinite(g).all())
    # Gumbel(0, 1) has mean ~0.5772
    assert abs(g.mean().item() - 0.5772) < 0.02


# ---- greedy / seeded -------------------------------------------------------------------------
def test_all_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    info = make_info(6, 40, temperature=0.0)
    assert info.all_greedy
    out = sample(logits, info, want_logprobs=False, top_k_logprobs=0)
    assert torch.equal(out.next_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None and out.top_ids is None


def test_temperature_zero_rows_greedy_in_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(64, 30)
    temps = torch.tensor([0.0, 1.0] * 32)
    info = make_info(64, 30, temperature=temps, seeds=torch.arange(64))
    assert not info.all_greedy
    out = sample(logits, info, False, 0)
    greedy_rows = temps == 0
    assert torch.equal(out.next_ids[greedy_rows], logits.argmax(-1)[greedy_rows])
    # the sampled rows are not all greedy (flat-ish logits, 32 rows)
    assert not torch.equal(out.next_ids[~greedy_rows], logits.argmax(-1)[~greedy_rows])


def test_seeded_sampling_reproducible_and_batch_independent():
    torch.manual_seed(2)
    logits = torch.randn(8, 50)
    seeds = torch.tensor([11, 12, 13, 14, 15, 16, 17, 18])
    steps = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    info = make_info(8, 50, temperature=0.8, seeds=seeds, steps=steps)
    a = sample(logits, info, False, 0).next_ids
    b = sample(logits.clone(), make_info(8, 50, temperature=0.8, seeds=seeds, steps=steps), False, 0).next_ids
    assert torch.equal(a, b)
    # same row sampled alone, or in reverse order: same token
    for i in (0, 5):
        alone = sample(logits[i:i + 1], make_info(1, 50, temperature=0.8, seeds=seeds[i:i + 1],
                                                 steps=steps[i:i + 1]), False, 0).next_ids
        assert alone.item() == a[i].item()
    rev = sample(logits.flip(0), make_info(8, 50, temperature=0.8, seeds=seeds.flip(0),
                                           steps=steps.flip(0)), False, 0).next_ids
    assert torch.equal(rev.flip(0), a)


def test_different_seeds_give_different_draws():
    logits = torch.zeros(1, 100)  # uniform over 100 tokens
    draws = set()
    for s in range(20):
        draws.add(sample(logits, make_info(1, 100, seeds=[s]), False, 0).next_ids.item())
    assert len(draws) > 10
    draws_steps = {sample(logits, make_info(1, 100, seeds=[3], steps=[t]), False, 0).next_ids.item()
                   for t in range(20)}
    assert len(draws_steps) > 10


def test_top_k_one_equals_argmax():
    torch.manual_seed(3)
    logits = torch.randn(32, 64)
    info = make_info(32, 64, temperature=1.5, top_k=1, seeds=torch.arange(32))
    assert info.all_greedy  # planned on the host: top_k 1 is greedy whatever the temperature
    out = sample(logits, info, False, 0)
    assert torch.equal(out.next_ids, logits.argmax(-1))


# ---- filtering ----------------------------------------------------------------------------------
# Hand-made distribution, deliberately not sorted: token -> prob
PROBS = torch.tensor([[0.10, 0.40, 0.05, 0.30, 0.15]])  # order: 1 (.40), 3 (.30), 4 (.15), 0 (.10), 2 (.05)


@pytest.mark.parametrize("kw, kept", [
    ({}, {0, 1, 2, 3, 4}),
    ({"top_k": 1}, {1}),
    ({"top_k": 2}, {1, 3}),
    ({"top_k": 3}, {1, 3, 4}),
    ({"top_k": 5}, {0, 1, 2, 3, 4}),
    ({"top_p": 0.35}, {1}),            # cum before: .00 .40 .70 .85 .95
    ({"top_p": 0.5}, {1, 3}),
    ({"top_p": 0.75}, {1, 3, 4}),
    ({"top_p": 0.9}, {1, 3, 4, 0}),
    ({"top_p": 1.0}, {0, 1, 2, 3, 4}),
    ({"top_p": 0.01}, {1}),            # at least one survives
    ({"min_p": 0.5}, {1, 3}),          # threshold .20
    ({"min_p": 0.3}, {1, 3, 4}),       # threshold .12
    ({"min_p": 0.2}, {1, 3, 4, 0}),    # threshold .08
    ({"min_p": 1.0}, {1}),
    ({"top_k": 3, "top_p": 0.5}, {1, 3}),
    ({"top_k": 2, "min_p": 0.9}, {1}),
    ({"top_p": 0.9, "min_p": 0.3}, {1, 3, 4}),
])
def test_filter_probs_keeps_expected(kw, kept):
    info = make_info(1, 5, **kw)
    out = filter_probs(PROBS.clone(), info)
    got = set(torch.nonzero(out[0] > 0).flatten().tolist())
    assert got == kept
    # kept probabilities unchanged, dropped ones exactly zero
    mask = torch.zeros(5, dtype=torch.bool)
    mask[list(kept)] = True
    assert torch.equal(out[0][mask], PROBS[0][mask])
    assert bool((out[0][~mask] == 0).all())


def test_filter_probs_per_row_parameters():
    probs = PROBS.repeat(3, 1)
    info = make_info(3, 5, top_k=[1, 5, 5], top_p=[1.0, 0.5, 1.0], min_p=[0.0, 0.0, 0.3])
    out = filter_probs(probs, info)
    assert set(torch.nonzero(out[0]).flatten().tolist()) == {1}
    assert set(torch.nonzero(out[1]).flatten().tolist()) == {1, 3}
    assert set(torch.nonzero(out[2]).flatten().tolist()) == {1, 3, 4}


def test_sampling_respects_filters():
    logits = torch.log(PROBS).repeat(400, 1)
    for kw, allowed in (({"top_k": 2}, {1, 3}), ({"top_p": 0.75}, {1, 3, 4}), ({"min_p": 0.5}, {1, 3})):
        info = make_info(400, 5, seeds=torch.arange(400) + 1000, **kw)
        ids = sample(logits, info, False, 0).next_ids
        assert set(ids.tolist()) == allowed, kw


# ---- empirical distribution ------------------------------------------------------------------
def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical value for 3 degrees of freedom at p = 0.001
CHI2_3DOF_999 = 16.27


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_seeded_draws_match_softmax_across_seeds(temperature):
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5])
    n = 40_000
    info = make_info(n, 4, temperature=temperature, seeds=torch.arange(n) * 2654435761 % (2**62))
    ids = sample(logits.repeat(n, 1), info, False, 0).next_ids
    counts = torch.bincount(ids, minlength=4).double()
    probs = torch.softmax(logits.double() / temperature, -1)
    assert _chi_square(counts, probs) < CHI2_3DOF_999, (counts / n, probs)
    assert torch.allclose(counts / n, probs, atol=0.01)


def test_seeded_draws_match_softmax_across_steps():
    logits = torch.tensor([0.3, -1.0, 1.2, 0.0])
    n = 40_000
    info = make_info(n, 4, seeds=torch.full((n,), 987654321), steps=torch.arange(n))
    ids = sample(logits.repeat(n, 1), info, False, 0).next_ids
    counts = torch.bincount(ids, minlength=4).double()
    probs = torch.softmax(logits.double(), -1)
    assert _chi_square(counts, probs) < CHI2_3DOF_999, (counts / n, probs)


def test_filtered_draws_match_renormalised_distribution():
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5])
    n = 40_000
    info = make_info(n, 4, top_k=2, seeds=torch.arange(n) + 77)
    ids = sample(logits.repeat(n, 1), info, False, 0).next_ids
    counts = torch.bincount(ids, minlength=4).double()
    assert counts[1] == 0 and counts[2] == 0
    p = torch.softmax(torch.tensor([1.0, 0.5], dtype=torch.float64), -1)
    frac = counts[0] / n
    # binomial std ~ 0.0024
    assert abs(frac - p[0]) < 0.01, (frac, p)


# ---- penalties -------------------------------------------------------------------------------------
def _penalties(rep, freq, pres, counts, seen):
    r = len(counts)
    return Penalties(repetition=torch.tensor(rep, dtype=torch.float32).view(r, 1),
                     frequency=torch.tensor(freq, dtype=torch.float32).view(r, 1),
                     presence=torch.tensor(pres, dtype=torch.float32).view(r, 1),
                     output_counts=torch.tensor(counts, dtype=torch.float32),
                     seen=torch.tensor(seen, dtype=torch.bool))


def test_repetition_penalty():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    p = _penalties([2.0], [0.0], [0.0], [[0, 0, 0, 0, 0]], [[True, True, False, False, True]])
    out = apply_penalties(logits, p)
    assert torch.allclose(out, torch.tensor([[1.0, -4.0, 1.0, -1.0, 0.25]]))


def test_frequency_and_presence_penalty():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    counts = [[0, 1, 3, 0]]
    seen = [[False, True, True, True]]  # token 3 only in the prompt
    out = apply_penalties(logits, _penalties([1.0], [0.5], [0.0], counts, seen))
    assert torch.allclose(out, torch.tensor([[1.0, 0.5, -0.5, 1.0]]))
    out = apply_penalties(logits, _penalties([1.0], [0.0], [0.7], counts, seen))
    assert torch.allclose(out, torch.tensor([[1.0, 0.3, 0.3, 1.0]]))
    # negative values encourage
    out = apply_penalties(logits, _penalties([1.0], [-1.0], [-0.25], counts, seen))
    assert torch.allclose(out, torch.tensor([[1.0, 2.25, 4.25, 1.0]]))


def test_penalties_combined_per_row():
    logits = torch.tensor([[3.0, -1.0, 0.0], [3.0, -1.0, 0.0]])
    counts = [[2, 1, 0], [2, 1, 0]]
    seen = [[True, True, False], [True, True, False]]
    out = apply_penalties(logits, _penalties([1.5, 1.0], [0.25, 0.0], [0.5, 1.0], counts, seen))
    row0 = torch.tensor([3.0 / 1.5 - 0.5 - 0.5, -1.0 * 1.5 - 0.25 - 0.5, 0.0])
    row1 = torch.tensor([3.0 - 1.0, -1.0 - 1.0, 0.0])
    assert torch.allclose(out, torch.stack([row0, row1]))


def test_sample_applies_penalties_but_logprobs_use_raw_logits():
    logits = torch.tensor([[2.0, 1.9, -3.0]])
    pen = _penalties([2.0], [0.0], [0.0], [[1, 0, 0]], [[True, False, False]])
    info = make_info(1, 3, temperature=0.0, penalties=pen)
    out = sample(logits, info, True, 0)
    assert out.next_ids.item() == 1  # 2.0 / 2 = 1.0 < 1.9
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1)[:, 1])


# ---- banned tokens ------------------------------------------------------------------------------
def test_banned_tokens_never_chosen():
    n, v = 2000, 6
    logits = torch.tensor([5.0, 0.0, 0.0, 4.0, -1.0, 0.0]).repeat(n, 1)
    banned = torch.zeros(n, v, dtype=torch.bool)
    banned[:, 0] = True   # the argmax
    banned[:, 4] = True
    greedy = sample(logits, make_info(n, v, temperature=0.0, banned=banned), False, 0).next_ids
    assert bool((greedy == 3).all())
    sampled = sample(logits, make_info(n, v, temperature=2.0, seeds=torch.arange(n), banned=banned),
                     False, 0).next_ids
    assert not bool(((sampled == 0) | (sampled == 4)).any())
    assert set(sampled.tolist()) == {1, 2, 3, 5}
    filt = sample(logits, make_info(n, v, temperature=1.0, top_p=0.99, seeds=torch.arange(n),
                                    banned=banned), False, 0).next_ids
    assert not bool(((filt == 0) | (filt == 4)).any())


# ---- logprobs --------------------------------------------------------------------------------------
def test_logprobs_are_raw_log_softmax_at_chosen_ids():
    torch.manual_seed(4)
    logits = torch.randn(16, 20) * 3
    info = make_info(16, 20, temperature=0.7, top_k=5, seeds=torch.arange(16))
    out = sample(logits, info, want_logprobs=True, top_k_logprobs=0)
    ref = torch.log_softmax(logits, -1).gather(1, out.next_ids.unsqueeze(1)).squeeze(1)
    assert out.logprobs.shape == (16,)
    assert torch.allclose(out.logprobs, ref)
    assert out.top_logprobs is None and out.top_ids is None


def test_top_logprobs_sorted_and_consistent():
    torch.manual_seed(5)
    logits = torch.randn(8, 30)
    info = make_info(8, 30, temperature=0.0)
    out = sample(logits, info, want_logprobs=True, top_k_logprobs=5)
    lsm = torch.log_softmax(logits, -1)
    assert out.top_logprobs.shape == (8, 5) and out.top_ids.shape == (8, 5)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())
    assert torch.allclose(out.top_logprobs, lsm.gather(1, out.top_ids))
    assert torch.allclose(out.top_logprobs, lsm.sort(-1, descending=True).values[:, :5])
    # greedy: the chosen token is the first top entry
    assert torch.equal(out.top_ids[:, 0], out.next_ids)
    assert torch.allclose(out.logprobs, out.top_logprobs[:, 0])
    # top_logprobs alone (without want_logprobs) still returns the chosen logprob
    out2 = sample(logits, info, want_logprobs=False, top_k_logprobs=2)
    assert out2.top_logprobs.shape == (8, 2)
    assert out2.logprobs is not None


# ---- the hash: cheap, and still a good source of independent uniforms ------------------------------
def _pair_chi2_z(a: torch.Tensor, b: torch.Tensor, bins: int = 32) -> float:
    """z-score of the chi-square of the 2-D histogram of pairs (a, b) of uniforms."""
    cells = (a * bins).long() * bins + (b * bins).long()
    counts = torch.bincount(cells.flatten(), minlength=bins * bins).double()
    expected = counts.sum() / bins ** 2
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = bins ** 2 - 1
    return (chi2 - dof) / (2 * dof) ** 0.5


def test_row_key_same_on_ints_and_tensors():
    seeds = [0, 1, 7, 12345, 2**32 - 1, 2**32, 2**40 + 3, 2**63 - 1]
    steps = [0, 1, 2, 99, 1000, 2**20, 5, 77]
    on_tensors = row_key(torch.tensor(seeds), torch.tensor(steps)).tolist()
    assert on_tensors == [row_key(s, t) for s, t in zip(seeds, steps)]
    assert all(0 <= k < 2**32 for k in on_tensors)
    assert len(set(on_tensors)) == len(seeds)


def test_uniform_noise_bucket_chi_square():
    seeds = torch.arange(2000, dtype=torch.int64) * 7919 + 3
    u = uniform_noise(seeds, torch.arange(2000) % 17, 500).flatten()
    counts = torch.histc(u, bins=100, min=0.0, max=1.0).double()
    expected = u.numel() / 100
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 148.2, chi2  # 99 degrees of freedom, p = 0.001


@pytest.mark.parametrize("seed", [0, 42, 2**40 + 3])
def test_uniform_noise_independent_across_tokens_and_steps(seed):
    """Neighbouring tokens of a row, and the same token at consecutive steps of one
    request, are independent: the 2-D histograms of the pairs are flat."""
    n = 4000
    u = uniform_noise(torch.full((n,), seed), torch.arange(n), 600)
    for lag in (1, 2, 7):
        assert abs(_pair_chi2_z(u[:, :-lag], u[:, lag:])) < 4.5, lag
    assert abs(_pair_chi2_z(u[:-1], u[1:])) < 4.5
    # consecutive seeds at the same step too
    v = uniform_noise(torch.arange(n) + seed, torch.zeros(n, dtype=torch.int64), 600)
    assert abs(_pair_chi2_z(v[:-1], v[1:])) < 4.5
    corr = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    assert abs(float(corr)) < 0.005


def test_gumbel_transform_finite_on_every_hash_value():
    """u = (v + 0.5) / 2^23 for every 23-bit v: strictly inside (0, 1), Gumbel finite."""
    v = torch.arange(2**23, dtype=torch.int64)
    u = (v * 512).float().add_(256.0).mul_(2.0 ** -32)  # as _hash_uniform keeps v: bits 9..31
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert torch.equal(u.double(), (v.double() + 0.5) / 2**23)  # exact in float32
    assert u.unique().numel() == 2**23
    g = u.log().neg().log().neg()
    assert bool(torch.isfinite(g).all())


# ---- ranked candidates: a partial selection gives the full sort's tokens ----------------------------
def _reference_draw(logp_row: torch.Tensor, seed: int, step: int, top_k: int, top_p: float, min_p: float) -> int:
    """The documented rule, one row at a time: rank by log-prob (ties: lowest id),
    keep by position, draw the Gumbel max in rank order."""
    vocab = logp_row.shape[0]
    order = sorted(range(vocab), key=lambda t: (-float(logp_row[t]), t))
    vals = logp_row[order]
    p = vals.exp()
    before = p.cumsum(0) - p
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep[top_k:] = False
    if top_p < 1:
        keep &= before <= top_p
    keep &= vals >= vals[0] + torch.tensor(min_p).log()
    keep[0] = True
    g = gumbel_noise(torch.tensor([seed]), torch.tensor([step]), vocab)[0]
    scores = torch.where(keep, vals, torch.tensor(float("-inf"))) + g[order]
    return order[int(scores.argmax())]


def _tied_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # coarse values: many exact ties, also at the top-k boundary
    return (torch.randn(rows, vocab, generator=g) * 2).round() / 2


PARAM_MIXES = [
    dict(top_k=5),
    dict(top_k=[1, 2, 3, 8, 20, 40, 3, 5]),
    dict(top_k=7, top_p=0.6),
    dict(top_k=30, min_p=0.2),
    dict(top_k=[4, 9, 16, 25, 3, 12, 40, 2], top_p=[0.3, 0.5, 0.9, 1.0, 0.95, 0.7, 0.2, 1.0],
         min_p=[0.0, 0.05, 0.1, 0.0, 0.3, 0.0, 0.01, 0.5]),
    dict(top_p=0.8),
    dict(min_p=0.25),
    dict(top_k=[10, -1, 10, -1, 6, -1, 3, -1], top_p=[1.0, 0.7, 1.0, 1.0, 0.5, 1.0, 1.0, 0.9],
         min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.2]),
]


@pytest.mark.parametrize("mix", range(len(PARAM_MIXES)))
@pytest.mark.parametrize("temperature", [1.0, [0.0, 0.7, 1.3, 0.0, 2.0, 0.5, 1.0, 0.9]])
def test_partial_selection_equals_full_sort_and_reference(mix, temperature, monkeypatch):
    rows, vocab = 8, 64
    kw = PARAM_MIXES[mix]
    seeds, steps = torch.arange(rows) * 1000 + mix, torch.arange(rows) % 3
    got = {}
    for cap in (sampler.CANDIDATE_CAP, 0):  # cap 0: every ranked row takes the full sort
        monkeypatch.setattr(sampler, "CANDIDATE_CAP", cap)
        for trial in range(6):
            logits = _tied_logits(rows, vocab, 100 * mix + trial)
            info = make_info(rows, vocab, temperature=temperature, seeds=seeds + trial, steps=steps, **kw)
            got[cap, trial] = sample(logits, info, False, 0).next_ids
    for trial in range(6):
        assert torch.equal(got[sampler.CANDIDATE_CAP, trial], got[0, trial])
    # and both are the documented rule, row by row
    temps = temperature if isinstance(temperature, list) else [temperature] * rows
    col = {k: (v if isinstance(v, list) else [v] * rows) for k, v in kw.items()}
    for trial in range(6):
        logits = _tied_logits(rows, vocab, 100 * mix + trial)
        for i in range(rows):
            top_k, top_p, min_p = (col.get("top_k", [-1] * rows)[i], col.get("top_p", [1.0] * rows)[i],
                                   col.get("min_p", [0.0] * rows)[i])
            if temps[i] == 0 or top_k == 1:
                want = int(logits[i].argmax())
            else:
                logp = torch.log_softmax(logits[i:i + 1] / temps[i], -1)[0]
                want = _reference_draw(logp, int(seeds[i]) + trial, int(steps[i]), top_k, top_p, min_p)
            assert int(got[0, trial][i]) == want, (trial, i)


def test_partial_selection_is_used_and_capped():
    info = make_info(3, 5000, top_k=[50, 7, 200])
    assert info.candidates == 200 and info.free_rows is None
    assert info.use_top_k and not info.use_top_p and not info.use_min_p
    assert make_info(2, 5000, top_k=[50, 2000]).candidates == 5000  # over the cap: full sort
    assert make_info(2, 5000, top_p=[0.9, 1.0]).candidates == 5000  # top-p without a top-k
    mixed = make_info(3, 5000, top_k=[50, -1, 1], min_p=[0, 0.1, 0])
    assert mixed.candidates == 50 and mixed.use_min_p and not mixed.use_top_p
    assert mixed.ranked_rows.tolist() == [0] and mixed.free_rows.tolist() == [1]
    only_min_p = make_info(2, 5000, min_p=0.1)
    assert only_min_p.candidates == 0 and only_min_p.ranked_rows is None
    assert make_info(2, 50, temperature=[0.0, 0.0], top_k=5).all_greedy


def test_rows_draw_the_same_alone_and_in_any_batch():
    """A row's token depends on its own values only, whatever path the batch takes."""
    vocab = 300
    logits = _tied_logits(6, vocab, 7)
    kw = dict(temperature=[0.0, 0.8, 1.0, 1.2, 0.9, 1.0], top_k=[-1, 20, -1, -1, 2000, 5],
              top_p=[1.0, 0.9, 1.0, 0.8, 1.0, 1.0], min_p=[0.0, 0.0, 0.2, 0.0, 0.1, 0.0],
              seeds=[5, 6, 7, 8, 9, 10], steps=[0, 1, 2, 3, 4, 5])
    batch = sample(logits, make_info(6, vocab, **kw), False, 0).next_ids
    for i in range(6):
        one = {k: [v[i]] for k, v in kw.items()}
        assert int(sample(logits[i:i + 1], make_info(1, vocab, **one), False, 0).next_ids) == int(batch[i])
    for pair in ((1, 5), (2, 3), (0, 4), (3, 5)):
        sub = {k: [v[j] for j in pair] for k, v in kw.items()}
        ids = sample(logits[list(pair)], make_info(2, vocab, **sub), False, 0).next_ids
        assert ids.tolist() == [int(batch[j]) for j in pair]


def test_top_k_ties_keep_lowest_ids():
    logits = torch.tensor([[1.0, 2.0, 1.0, 2.0, 1.0, 0.0]]).repeat(300, 1)
    ids = sample(logits, make_info(300, 6, top_k=3, seeds=torch.arange(300)), False, 0).next_ids
    assert set(ids.tolist()) == {0, 1, 3}


# ---- penalty state on the device: incremental equals from scratch ------------------------------------
def _req(rid: str, prompt: list[int], seed: int = 0, **params) -> Req:
    return Req(rid=rid, prompt_ids=prompt, params=SamplingParams(**params), seed=seed)


class _View(DrawView):
    """A request mid speculative round that names its request: the incremental path."""

    def __init__(self, req: Req, path: list[int]) -> None:
        super().__init__(req, path)
        self.base, self.extra_ids = req, path


def _from_scratch(rows, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The old host computation: count every row's output, mark its prompt and output."""
    counts = torch.zeros(len(rows), vocab)
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for i, r in enumerate(rows):
        for t in r.output_ids:
            counts[i, t] += 1
        seen[i, r.fill_ids] = True
    return counts, seen


_SAMPLERS: dict[int, batch_mod.Sampler] = {}


def sampler_for(vocab: int) -> batch_mod.Sampler:
    """One sampler per vocabulary for the whole module, as one scheduler keeps one."""
    if vocab not in _SAMPLERS:
        _SAMPLERS[vocab] = batch_mod.Sampler(vocab, (), torch.device("cpu"))
    return _SAMPLERS[vocab]


def _check_penalties(rows, vocab: int) -> None:
    pen = sampler_for(vocab).penalties(rows)
    counts, seen = _from_scratch(rows, vocab)
    for i, r in enumerate(rows):
        if r.params.needs_penalties:
            assert torch.equal(pen.output_counts[i], counts[i]), i
            assert torch.equal(pen.seen[i], seen[i]), i
            assert pen.repetition[i, 0] == torch.tensor(r.params.repetition_penalty, dtype=torch.float32)
            assert pen.frequency[i, 0] == torch.tensor(r.params.frequency_penalty, dtype=torch.float32)
            assert pen.presence[i, 0] == torch.tensor(r.params.presence_penalty, dtype=torch.float32)
        else:  # neutral parameters: the all-zero row, no effect
            assert not bool(pen.output_counts[i].any()) and not bool(pen.seen[i].any())
    logits = torch.randn(len(rows), vocab)
    full = Penalties(pen.repetition, pen.frequency, pen.presence, counts, seen)
    assert torch.equal(apply_penalties(logits, pen), apply_penalties(logits, full))


@pytest.mark.parametrize("seed", range(4))
def test_incremental_penalties_equal_from_scratch(seed):
    import random

    rng = random.Random(seed)
    vocab = 40
    pen_kw = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=-0.25),
              dict(repetition_penalty=0.8, presence_penalty=1.0), {}]

    def new_req(prompt=None):
        prompt = prompt if prompt is not None else [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        return _req(f"r{rng.random()}", prompt, seed=rng.randrange(2**40), **rng.choice(pen_kw))

    live = [new_req() for _ in range(6)]
    for step in range(60):
        # Draw: a random batch, some rows as views (named: incremental; DrawView: from scratch).
        rows = []
        for r in rng.sample(live, rng.randint(1, len(live))):
            kind = rng.random()
            path = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
            rows.append(r if kind < 0.5 else _View(r, path) if kind < 0.8 else DrawView(r, path))
            if kind > 0.9:  # several nodes of one request's tree in the same draw
                rows.append(_View(r, path[:1]))
        _check_penalties(rows, vocab)
        # Then the requests move on.
        for r in list(live):
            event = rng.random()
            if event < 0.6:
                r.output_ids.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))
            elif event < 0.65 and r.output_ids:  # output truncated
                del r.output_ids[rng.randrange(len(r.output_ids)):]
            elif event < 0.68 and r.output_ids:  # truncated and regrown past its length
                last = r.output_ids[-1]
                r.output_ids[rng.randrange(len(r.output_ids)):] = [(last + 1) % vocab] * 4
            elif event < 0.7:  # replaced by another list (equal, or differing before its last token)
                r.output_ids = list(r.output_ids)
                if len(r.output_ids) > 1 and rng.random() < 0.5:
                    r.output_ids[0] = (r.output_ids[0] + 1) % vocab
            elif event < 0.75:  # finished
                r.finish = FinishReason(FinishKind.LENGTH)
                live.remove(r)
            # else: not drawn (e.g. retracted: its output is kept, its KV recomputed)
        if rng.random() < 0.3:  # a new prompt with n samples sharing it
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            live += [new_req(prompt) for _ in range(rng.randint(1, 3))]
        if not live:
            live.append(new_req())


def test_penalty_state_counts_only_new_tokens_and_is_released():
    vocab = 30
    reqs = [_req(f"r{i}", [1, 2, 3], frequency_penalty=0.5) for i in range(3)]
    _check_penalties(reqs, vocab)
    book = sampler_for(vocab).book
    slots = {book.held[r].slot for r in reqs}
    assert len(slots) == 3 and 0 not in slots
    for r in reqs:
        r.output_ids += [4, 4]
    _check_penalties(reqs, vocab)
    assert [book.held[r].n for r in reqs] == [2, 2, 2]
    # more requests than slots: the rows grow, state kept
    more = [_req(f"m{i}", [5], presence_penalty=1.0) for i in range(40)]
    _check_penalties(reqs + more, vocab)
    assert book.rows.capacity >= 44
    for r in reqs + more:
        r.finish = FinishReason(FinishKind.STOP)
    plain = _req("plain", [1])
    sampler_for(vocab).sampling_info([plain])  # no penalties: finished state goes away
    assert sampler_for(vocab).book is None


# ---- draw: one device read -----------------------------------------------------------------------
def _mixed_batch() -> list[Req]:
    reqs = [_req("greedy", [1, 2, 3], temperature=0.0),
            _req("topk_topp", [4, 5], seed=7, temperature=0.8, top_p=0.9, top_k=20),
            _req("penalties", [6, 7, 6], seed=8, repetition_penalty=1.2, frequency_penalty=0.3,
                 presence_penalty=0.2),
            _req("min_new", [8], seed=9, temperature=1.0, min_new_tokens=5, stop_token_ids=[3],
                 min_p=0.05),
            _req("logprobs", [9, 10], seed=10, temperature=1.1)]
    reqs[2].output_ids += [6, 11, 11]
    reqs[4].return_logprob, reqs[4].top_logprobs_num = True, 3
    return reqs


def test_draw_reads_the_device_exactly_once(monkeypatch):
    vocab = 64
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    reqs = _mixed_batch()
    expected = batch_mod.Sampler(vocab, (2,), torch.device("cpu")).draw(logits, reqs, reqs)
    reqs = _mixed_batch()  # fresh penalty state: the draw below also creates it

    fetched = []
    inside_fetch = [False]
    real_fetch, real_tolist = device_io.fetch, torch.Tensor.tolist

    def fetch(x):
        fetched.append(tuple(x.shape))
        inside_fetch[0] = True
        try:
            return real_fetch(x)
        finally:
            inside_fetch[0] = False

    def tolist(self):
        if not inside_fetch[0]:
            raise AssertionError("Tensor.tolist outside device_io.fetch")
        return real_tolist(self)

    def forbidden(name):
        def read(self, *args):
            raise AssertionError(f"Tensor.{name} reads the device")
        return read

    monkeypatch.setattr(device_io, "fetch", fetch)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    for name in ("item", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(name))
    got = batch_mod.Sampler(vocab, (2,), torch.device("cpu"), TPGroup()).draw(logits, reqs, reqs)
    monkeypatch.undo()
    assert fetched == [(5, 1 + 1 + 2 * 3)]
    assert got == expected
    # what the packed transfer carried is what sample() computed
    info = batch_mod.Sampler(vocab, (2,), torch.device("cpu")).sampling_info(_mixed_batch())
    out = sample(logits, info, True, 3)
    assert got.ids == out.next_ids.tolist()
    assert got.logprobs == out.logprobs.tolist()
    assert got.top_logprobs == out.top_logprobs.tolist() and got.top_ids == out.top_ids.tolist()
    assert got.ids[0] == int(logits[0].argmax())
    assert got.ids[3] not in (2, 3)  # min_new_tokens bans eos and the stop token


def test_draw_without_logprobs_fetches_ids_only(monkeypatch):
    fetched = []
    real_fetch = device_io.fetch
    monkeypatch.setattr(device_io, "fetch", lambda x: fetched.append(tuple(x.shape)) or real_fetch(x))
    reqs = [_req("a", [1], temperature=0.0), _req("b", [2], seed=3)]
    got = batch_mod.Sampler(16, (), torch.device("cpu")).draw(torch.randn(2, 16), reqs, reqs)
    assert fetched == [(2, 1)]
    assert got.logprobs is None and got.top_logprobs is None and got.top_ids is None
    assert all(isinstance(t, int) for t in got.ids)


def test_sampler_benchmark_runs(capsys):
    from pdserve.bench import sampler as bench

    bench.main(["--batch", "4", "--vocab", "300", "--iters", "1", "--device", "cpu", "--prompt-len", "8",
                "--output-len", "4"])
    out = capsys.readouterr().out
    for case in bench.CASES:
        assert case in out
    assert "(same ids)" in out  # greedy: the legacy and the new sampler agree
