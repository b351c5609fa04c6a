"""Sampler: hashed noise, greedy / seeded sampling, filters, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.sampler import (Penalties, SamplingInfo, apply_penalties, filter_probs, gumbel_noise,
                                   sample, uniform_noise)


def make_info(rows: int, vocab: int, *, temperature=1.0, top_p=1.0, top_k=None, min_p=0.0,
              seeds=None, steps=None, penalties=None, banned=None) -> SamplingInfo:
    def col(v, dtype):
        if isinstance(v, torch.Tensor):
            return v.to(dtype)
        if isinstance(v, (list, tuple)):
            return torch.tensor(v, dtype=dtype)
        return torch.full((rows,), v, dtype=dtype)

    temps = col(temperature, torch.float32)
    top_ps = col(top_p, torch.float32)
    top_ks = col(vocab if top_k is None else top_k, torch.int64)
    top_ks = torch.where(top_ks < 0, torch.full_like(top_ks, vocab), top_ks)
    min_ps = col(min_p, torch.float32)
    seeds = col(0 if seeds is None else seeds, torch.int64)
    steps = col(0 if steps is None else steps, torch.int64)
    need_filter = bool((top_ps < 1).any() or (top_ks < vocab).any() or (min_ps > 0).any())
    return SamplingInfo(temperatures=temps, top_ps=top_ps, top_ks=top_ks, min_ps=min_ps, seeds=seeds,
                        steps=steps, all_greedy=bool((temps == 0).all()), need_filter=need_filter,
                        penalties=penalties, banned=banned)


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
    assert info.need_filter
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
