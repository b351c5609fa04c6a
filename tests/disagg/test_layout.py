"""Named KV layouts: buffers pair by name (the first seed's V-shift is impossible), head
slicing across TP sizes moves every head exactly once, writes coalesce, and incompatible
pairs are refused naming the mismatch."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.disagg.layout import (PROTOCOL_VERSION, BufferSpec, CompatRecord, HandshakeError, HeadRange, KVLayout,
                                   check_compatible, feature_slice, kv_head_range, plan_transfer)
from pdserve.disagg.transfer import LocalTransfer, WriteBatch, coalesce, split_batch, split_entries

pytestmark = pytest.mark.fast

SLOTS, HEAD_DIM = 12, 4


def pool(prefix: str, layers: int, heads: int, head_range=None, fill: float | None = None) -> dict[str, torch.Tensor]:
    """Named per-layer K/V buffers [slots, heads, head_dim] (random, or constant `fill`)."""
    out = {}
    for i in range(layers):
        for kind in ("K", "V"):
            t = torch.randn(SLOTS, heads, HEAD_DIM) if fill is None else torch.full((SLOTS, heads, HEAD_DIM), fill)
            out[f"{prefix}.L{i}.{kind}"] = t
    return out


def layout(buffers: dict[str, torch.Tensor], page_size: int = 1, heads=None) -> KVLayout:
    specs = []
    for name, t in buffers.items():
        specs.append(BufferSpec(name, t.data_ptr(), t.shape[0], t[0].numel() * t.element_size(),
                                heads if name.startswith(("target", "draft")) and heads is not None else None))
    return KVLayout(page_size, tuple(specs))


def test_decode_only_draft_layers_cannot_shift_target_values():
    """Seed 1: prefill without a draft, decode with one. Positional K/V halves put prefill's
    V of layer i into decode's layer i+1; pairing by name puts every buffer in its place."""
    layers = 6
    prefill = pool("target", layers, 2)
    decode = {**pool("target", layers, 2, fill=0.0), **pool("draft", 1, 2, fill=-1.0)}
    plan = plan_transfer(layout(prefill), layout(decode), wanted=list(pool("target", layers, 2)))
    assert [p.src.name for p in plan.pairs] == [p.dst.name for p in plan.pairs]
    slots = [1, 2, 3, 7]
    LocalTransfer().write("self", plan.writes(slots, [4, 5, 6, 9]))
    for name, src in prefill.items():
        assert torch.equal(decode[name][[4, 5, 6, 9]], src[slots]), name
        assert torch.equal(decode[name][0], torch.zeros(2, HEAD_DIM))  # nothing else written
    for name in ("draft.L0.K", "draft.L0.V"):
        assert bool((decode[name] == -1.0).all()), f"{name} was overwritten"


def test_missing_or_mismatched_buffers_are_refused():
    prefill = pool("target", 2, 2)
    decode = {**pool("target", 2, 2), **pool("draft", 1, 2)}
    with pytest.raises(HandshakeError, match="draft.L0.K"):
        plan_transfer(layout(prefill), layout(decode), wanted=list(decode))
    with pytest.raises(HandshakeError, match="page_size"):
        plan_transfer(layout(prefill, 16), layout(decode, 1), wanted=["target.L0.K"])
    wide = pool("target", 2, 3)
    with pytest.raises(HandshakeError, match="target.L0.K"):
        plan_transfer(layout(wide), layout(decode), wanted=["target.L0.K"])


def test_contiguous_slots_coalesce_and_batches_split():
    buffers = pool("target", 1, 2)
    dst = pool("target", 1, 2, fill=0.0)
    plan = plan_transfer(layout(buffers), layout(dst), wanted=list(buffers))
    batch = plan.writes([0, 1, 2, 3, 8], [4, 5, 6, 7, 10])
    assert len(batch.src) == 2 * 2  # per buffer: one run of 4 slots + one single slot
    assert batch.nbytes == 2 * 5 * 2 * HEAD_DIM * 4
    assert coalesce([0, 8, 16, 40], [100, 108, 116, 200], 8).lengths == (24, 8)
    parts = split_batch(WriteBatch(tuple(range(2500)), tuple(range(2500)), (1,) * 2500), 1024)
    assert [len(p.src) for p in parts] == [1024, 1024, 452]
    with pytest.raises(ValueError, match="destination slots"):
        plan.writes([0, 1], [2])


def test_long_entries_split_into_pieces_that_cover_the_same_bytes():
    batch = WriteBatch((1000, 5000), (20000, 90000), (2500, 300))
    pieces = split_entries(batch, 1024)
    assert pieces.lengths == (1024, 1024, 452, 300)
    assert pieces.src == (1000, 2024, 3048, 5000) and pieces.dst == (20000, 21024, 22048, 90000)
    assert split_entries(batch, None) is batch and split_entries(batch, 4096) is batch
    with pytest.raises(ValueError, match="max_entry_bytes"):
        split_entries(batch, 0)
    # Moved through an engine, the pieces land what the whole entries would.
    src = torch.arange(4096, dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    LocalTransfer().write("local", split_entries(WriteBatch((src.data_ptr(),), (dst.data_ptr(),), (4096,)), 1000))
    assert torch.equal(src, dst)


@pytest.mark.parametrize("kv_heads,p_tp,d_tp", [
    (h, p, d) for h, p, d in itertools.product([1, 2, 4, 8], [1, 2, 4], [1, 2, 4])])
def test_head_slicing_moves_every_head_once(kv_heads, p_tp, d_tp):
    full = torch.randn(SLOTS, kv_heads, HEAD_DIM)
    p_ranges = [kv_head_range(kv_heads, r, p_tp) for r in range(p_tp)]
    d_ranges = [kv_head_range(kv_heads, r, d_tp) for r in range(d_tp)]
    p_bufs = [{"target.L0.K": full[:, hr.start: hr.end].contiguous()} for hr in p_ranges]
    d_bufs = [{"target.L0.K": torch.zeros(SLOTS, hr.count, HEAD_DIM)} for hr in d_ranges]
    writes_per_head: dict[tuple[int, int], int] = {}
    slots = [0, 3, 4]
    for pr in range(p_tp):
        for dr in range(d_tp):
            plan = plan_transfer(layout(p_bufs[pr], heads=p_ranges[pr]), layout(d_bufs[dr], heads=d_ranges[dr]),
                                 wanted=["target.L0.K"], prefill_rank=pr, prefill_head_ranges=p_ranges)
            for pair in plan.pairs:
                first = d_ranges[dr].start + pair.dst_offset // (HEAD_DIM * 4)
                for h in range(first, first + pair.length // (HEAD_DIM * 4)):
                    writes_per_head[(dr, h)] = writes_per_head.get((dr, h), 0) + 1
            LocalTransfer().write("self", plan.writes(slots, slots))
    for dr, hr in enumerate(d_ranges):
        assert torch.equal(d_bufs[dr]["target.L0.K"][slots], full[slots][:, hr.start: hr.end])
        for h in range(hr.start, hr.end):
            assert writes_per_head.get((dr, h)) == 1, (dr, h, writes_per_head)


@pytest.mark.parametrize("d_tp", [1, 2, 4])
def test_each_decode_rank_receives_its_feature_slice_once(d_tp):
    """Features are whole rows on every rank; each decode rank receives its 1/tp slice of
    the rows (the ranks all-gather the rest), so the rows cross the wire once."""
    width = 12
    rows = torch.randn(SLOTS, width)
    elements = HeadRange(0, width, width)
    src = KVLayout(1, (BufferSpec("features", rows.data_ptr(), SLOTS, width * 4, elements),))
    pools = [torch.zeros(SLOTS, width) for _ in range(d_tp)]
    sent = 0
    slots = [1, 2, 3, 9]
    for rank, dst_pool in enumerate(pools):
        part = feature_slice(width, rank, d_tp)
        dst = KVLayout(1, (BufferSpec("features", dst_pool.data_ptr(), SLOTS, width * 4, elements, part),))
        batch = plan_transfer(src, dst, ["features"]).writes(slots, slots)
        LocalTransfer().write("self", batch)
        sent += batch.nbytes
        lo, hi = (part.start, part.end) if part is not None else (0, width)
        assert torch.equal(dst_pool[slots, lo:hi], rows[slots, lo:hi])
        assert bool((dst_pool[:, :lo] == 0).all()) and bool((dst_pool[:, hi:] == 0).all())  # nothing else written
    assert sent == len(slots) * width * 4
    assert feature_slice(10, 0, 4) is None  # uneven: every rank receives whole rows
    with pytest.raises(ValueError, match="receives"):
        BufferSpec("features", 0, 1, 4, None, HeadRange(0, 1, 4))


def test_compat_record_names_the_mismatch():
    base = CompatRecord(PROTOCOL_VERSION, "LlamaForCausalLM", 4, 4, 64, "float32", 1, 104)
    check_compatible(base, base)
    for field_name, value in (("page_size", 16), ("kv_dtype", "bfloat16"), ("num_layers", 5),
                              ("protocol_version", 99), ("architecture", "Qwen3ForCausalLM")):
        other = CompatRecord(**{**base.__dict__, field_name: value})
        with pytest.raises(HandshakeError, match=field_name):
            check_compatible(base, other)
    eagle = CompatRecord(**{**base.__dict__, "speculative_algorithm": "EAGLE", "feature_width": 256})
    eagle3 = CompatRecord(**{**base.__dict__, "speculative_algorithm": "EAGLE3", "feature_width": 768})
    check_compatible(base, eagle)   # plain prefill, speculative decode
    check_compatible(eagle, base)   # and the reverse
    with pytest.raises(HandshakeError, match="speculative_algorithm: EAGLE vs EAGLE3"):
        check_compatible(eagle, eagle3)
    # A peer of the previous protocol (no landing area) is refused by name.
    old = CompatRecord(**{**base.__dict__, "protocol_version": 6})
    with pytest.raises(HandshakeError, match=f"protocol_version: 6 vs {PROTOCOL_VERSION} \\(pdserve releases with "
                                             "different PD protocols: run the same release on both sides\\)"):
        check_compatible(old, base)
    assert PROTOCOL_VERSION == 7


def test_only_the_same_draft_and_top_k_share_the_draft_state():
    base = CompatRecord(PROTOCOL_VERSION, "LlamaForCausalLM", 4, 4, 64, "float32", 1, 104, "EAGLE", 256)
    mine = CompatRecord(**{**base.__dict__, "draft_identity": "abc", "eagle_topk": 4})
    assert mine.shares_draft_with(mine)
    assert not mine.shares_draft_with(CompatRecord(**{**mine.__dict__, "draft_identity": "abd"}))
    assert not mine.shares_draft_with(CompatRecord(**{**mine.__dict__, "eagle_topk": 1}))
    assert not base.shares_draft_with(base)  # no draft: nothing to share
    check_compatible(mine, CompatRecord(**{**mine.__dict__, "draft_identity": "abd"}))  # (the feature path)
