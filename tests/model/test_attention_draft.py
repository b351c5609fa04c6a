"""The draft model's attention shapes (issue 23): a draft tree step reads each
request's prefix KV once for all its branches, and short extends of ragged
lengths run as one padded SDPA. Both must equal the plans they replace: the
per-branch expanded decode and the per-row extend."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.attention import PAD_EXTEND_MAX, ForwardContext, NativePlan, RowLayout, TorchNativeAttention
from pdserve.scheduler.memory import TokenToKVPool

HEAD_DIM = 8
WIDTH = 40  # positions per request-table row


def make_backend(num_heads: int, num_kv_heads: int, rows: int, seed: int = 0
                 ) -> tuple[TorchNativeAttention, TokenToKVPool, torch.Tensor]:
    """A one-layer fp32 pool with random KV everywhere and a request table of distinct
    slots (slot 0, the padding slot, belongs to no row)."""
    g = torch.Generator().manual_seed(seed)
    num_slots = rows * WIDTH + 1
    pool = TokenToKVPool("t", 1, num_slots, num_kv_heads, HEAD_DIM, torch.float32, torch.device("cpu"))
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    table = (torch.randperm(num_slots - 1, generator=g) + 1).view(rows, WIDTH)
    return TorchNativeAttention(pool, num_heads, num_kv_heads, HEAD_DIM), pool, table


def new_tokens(n: int, num_heads: int, num_kv_heads: int, seed: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, num_heads, HEAD_DIM, generator=g), torch.randn(n, num_kv_heads, HEAD_DIM, generator=g),
            torch.randn(n, num_kv_heads, HEAD_DIM, generator=g))


def tree_step_inputs(table: torch.Tensor, kv_lens: list[int], k: int, depth: int, seed: int = 2):
    """A tree step's slots as propose builds them: every request's prefix (padded to
    the longest) and per branch ``depth`` distinct scratch slots past kv_len."""
    g = torch.Generator().manual_seed(seed)
    b = len(kv_lens)
    rows = torch.arange(b)
    n = torch.tensor(kv_lens)
    pos = torch.arange(max(kv_lens))
    prefix_slots, prefix_valid = table[rows.unsqueeze(1), pos], pos.unsqueeze(0) < n.unsqueeze(1)
    offs = torch.stack([torch.randperm(k * depth, generator=g).view(k, depth) for _ in range(b)])  # [B, k, i]
    branch_slots = table[rows.view(b, 1, 1), n.view(b, 1, 1) + offs]
    positions = (n + depth - 1).repeat_interleave(k)
    return prefix_slots, prefix_valid, branch_slots, positions


def expanded_context(prefix_slots, prefix_valid, branch_slots, positions) -> ForwardContext:
    """The plan the tree step replaced: every branch a decode row over [its request's
    prefix | its own slots], so the prefix is gathered once per branch."""
    b, k, i = branch_slots.shape
    lp = prefix_slots.shape[1]
    kv = torch.cat([prefix_slots.unsqueeze(1).expand(b, k, lp), branch_slots], dim=2).view(b * k, -1)
    valid = torch.cat([prefix_valid.unsqueeze(1).expand(b, k, lp), torch.ones(b, k, i, dtype=torch.bool)],
                      dim=2).view(b * k, -1)
    return ForwardContext(positions, branch_slots[:, :, -1].reshape(-1), b * k, True,
                          plan=NativePlan(kv_indices=torch.where(valid, kv, 0), attn_mask=valid.view(b * k, 1, 1, -1)))


@pytest.mark.fast
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("k,depth", [(1, 1), (3, 1), (3, 3), (4, 2)])
def test_tree_step_equals_expanded_decode(heads, k, depth):
    num_heads, num_kv_heads = heads
    kv_lens = [5, 1, 17, 9]
    backend, _, table = make_backend(num_heads, num_kv_heads, len(kv_lens))
    inputs = tree_step_inputs(table, kv_lens, k, depth)
    q, kn, vn = new_tokens(len(kv_lens) * k, num_heads, num_kv_heads)
    prefix_slots, prefix_valid, branch_slots, positions = inputs
    ctx = ForwardContext.for_tree_step(prefix_slots, prefix_valid, branch_slots, positions,
                                       branch_slots[:, :, -1].reshape(-1))
    got = backend.forward(0, q, kn, vn, ctx)
    want = backend.forward(0, q, kn, vn, expanded_context(*inputs))
    assert got.shape == (len(kv_lens) * k, num_heads * HEAD_DIM)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.fast
def test_tree_step_gathers_the_prefix_once_per_request(monkeypatch):
    kv_lens, k, depth = [6, 11, 3], 4, 3
    backend, pool, table = make_backend(8, 2, len(kv_lens))
    prefix_slots, prefix_valid, branch_slots, positions = tree_step_inputs(table, kv_lens, k, depth)
    ctx = ForwardContext.for_tree_step(prefix_slots, prefix_valid, branch_slots, positions,
                                       branch_slots[:, :, -1].reshape(-1))
    shapes: list[tuple[int, ...]] = []
    real = pool.gather_head_major

    def recording(layer: int, indices: torch.Tensor):
        shapes.append(tuple(indices.shape))
        return real(layer, indices)

    monkeypatch.setattr(pool, "gather_head_major", recording)
    backend.forward(0, *new_tokens(len(kv_lens) * k, 8, 2), ctx)
    # one gather of B rows: the padded prefix once, then the k * i branch slots
    assert shapes == [(len(kv_lens), max(kv_lens) + k * depth)]


@pytest.mark.fast
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("prefix,extend", [
    ([0, 7, 3, 12], [3, 1, 5, 2]),     # ragged, one row without a prefix
    ([4, 9, 1], [1, 6, 3]),            # ragged, all with prefixes
    ([0, 0, 0], [2, 4, 1]),            # ragged, no prefixes
    ([2, 5], [3, 3]),                  # uniform: nothing to pad
    ([0, 3], [1, PAD_EXTEND_MAX]),     # the longest extend the padded plan takes
])
def test_padded_short_extend_equals_per_row_extend(heads, prefix, extend):
    num_heads, num_kv_heads = heads
    backend, _, table = make_backend(num_heads, num_kv_heads, len(prefix))
    layout = RowLayout.upload(list(range(len(prefix))), prefix, extend, torch.device("cpu"))
    per_row = ForwardContext.build(table, layout)
    padded = ForwardContext.build(table, layout, pad_short_extends=True)
    assert per_row.plan.spans and per_row.plan.grouped is None
    assert padded.plan.grouped is not None and padded.plan.grouped.visible.shape[1] == max(extend) \
        and not padded.plan.spans
    torch.testing.assert_close(padded.out_cache_loc, per_row.out_cache_loc, atol=0, rtol=0)
    q, kn, vn = new_tokens(sum(extend), num_heads, num_kv_heads)
    got = backend.forward(0, q, kn, vn, padded)
    want = backend.forward(0, q, kn, vn, per_row)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.fast
def test_long_extends_keep_the_per_row_plan():
    """A prompt prefill would pad every row to the longest: it keeps one SDPA per row."""
    _, _, table = make_backend(4, 4, 2)
    layout = RowLayout.upload([0, 1], [0, 2], [PAD_EXTEND_MAX + 1, 3], torch.device("cpu"))
    ctx = ForwardContext.build(table, layout, pad_short_extends=True)
    assert len(ctx.plan.spans) == 2 and ctx.plan.grouped is None


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("k,depth", [(1, 2), (3, 3)])
def test_triton_tree_step_equals_torch_native(heads, k, depth):
    """The triton draft tree step (each branch reads its request's prefix in place with
    the paged decode kernel, its own slots in torch, merged by log-sum-exp; lengths
    from the device only) gives the torch_native tree step's output, and writes the
    same KV."""
    from pdserve.model.triton_backend import TritonAttention

    num_heads, num_kv_heads = heads
    kv_lens = [5, 1, 17, 9]
    native, pool, table = make_backend(num_heads, num_kv_heads, len(kv_lens))
    triton_backend = TritonAttention(pool, num_heads, num_kv_heads, HEAD_DIM)
    _, _, branch_slots, positions = tree_step_inputs(table, kv_lens, k, depth)
    q, kn, vn = new_tokens(len(kv_lens) * k, num_heads, num_kv_heads)
    rows, n = torch.arange(len(kv_lens)), torch.tensor(kv_lens)
    outs = []
    for backend in (native, triton_backend):
        ctx = backend.tree_step_context(backend.plan_tree_round(table, rows, n, max(kv_lens)), branch_slots,
                                        positions)
        assert torch.equal(ctx.out_cache_loc, branch_slots[:, :, -1].reshape(-1))
        outs.append(backend.forward(0, q, kn, vn, ctx))
    assert torch.allclose(outs[0], outs[1], atol=1e-4), (outs[0] - outs[1]).abs().max()
    assert torch.equal(pool.k[0][branch_slots[:, :, -1].reshape(-1)], kn)
