"""The landing area: a scattered destination receives a request packed, in one write per
buffer and run of source slots, and ``unpack`` puts every byte where a direct write would
have (every head exactly once across TP sizes, a decode rank's feature slice, draft
buffers only when asked); pieces are first fit, aligned, merged when given back, and the
area returns to full."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from pdserve.disagg.landing import (LANDING_ALIGN, LandingArea, landing_bytes, landing_names, landing_regions,
                                    slot_runs, strided_source, worth_landing)
from pdserve.disagg.layout import BufferSpec, HandshakeError, HeadRange, KVLayout, feature_slice, kv_head_range, plan_transfer
from pdserve.disagg.transfer import LocalTransfer
from tests.disagg.test_layout import HEAD_DIM, SLOTS, layout, pool

pytestmark = pytest.mark.fast


def land_and_unpack(plans: list, dst_layout: KVLayout, dst_buffers: dict[str, torch.Tensor], src_slots: list[int],
                    dst_slots: list[int], names: list[str], area: LandingArea | None = None,
                    senders: dict | None = None) -> list[int]:
    """Write ``src_slots`` through each plan (one per prefill rank) into a landing piece for
    ``dst_slots`` and unpack it; the entry count of each plan's batch."""
    area = area or LandingArea(1 << 20)
    regions, size = landing_regions(dst_layout, names, len(dst_slots), senders)
    offset = area.take(size)
    assert offset is not None
    entries = []
    for plan in plans:
        batch = plan.landed(area.spec.ptr + offset, regions, len(dst_slots)).writes(src_slots, range(len(dst_slots)))
        LocalTransfer().write("self", batch)
        entries.append(len(batch.src))
    area.unpack(offset, regions, dst_slots, dst_buffers)
    area.give(offset)
    assert area.free_bytes == area.capacity and area.pieces == 0
    return entries


def test_a_scattered_destination_lands_in_one_entry_per_buffer_and_unpacks_exactly():
    src = pool("target", 2, 2)
    dst = pool("target", 2, 2, fill=0.0)
    src_slots = [2, 3, 4, 5, 6]       # one run on the prefill side
    dst_slots = [9, 1, 7, 3, 11]      # no two consecutive on decode: five entries per buffer direct
    plan = plan_transfer(layout(src), layout(dst), wanted=list(src))
    assert len(plan.writes(src_slots, dst_slots).src) == 4 * 5
    entries = land_and_unpack([plan], layout(dst), dst, src_slots, dst_slots, list(src))
    assert entries == [4]
    for name in src:
        assert torch.equal(dst[name][dst_slots], src[name][src_slots]), name
        untouched = [s for s in range(SLOTS) if s not in dst_slots]
        assert bool((dst[name][untouched] == 0).all()), f"{name}: a slot outside the request was written"


@pytest.mark.parametrize("kv_heads,p_tp,d_tp", [
    (h, p, d) for h, p, d in itertools.product([1, 2, 4], [1, 2, 4], [1, 2, 4])])
def test_landing_moves_every_head_once_across_tp_sizes(kv_heads, p_tp, d_tp):
    """As a direct write does (test_layout's head slicing): each decode rank's landing piece
    is written by every prefill rank that owes it heads, and unpacks to the same slots."""
    full = torch.randn(SLOTS, kv_heads, HEAD_DIM)
    p_ranges = [kv_head_range(kv_heads, r, p_tp) for r in range(p_tp)]
    d_ranges = [kv_head_range(kv_heads, r, d_tp) for r in range(d_tp)]
    p_bufs = [{"target.L0.K": full[:, hr.start: hr.end].contiguous()} for hr in p_ranges]
    d_bufs = [{"target.L0.K": torch.zeros(SLOTS, hr.count, HEAD_DIM)} for hr in d_ranges]
    src_slots, dst_slots = [3, 4, 5, 6], [8, 2, 6, 1]
    for dr in range(d_tp):
        dst_layout = layout(d_bufs[dr], heads=d_ranges[dr])
        plans = [plan_transfer(layout(p_bufs[pr], heads=p_ranges[pr]), dst_layout, wanted=["target.L0.K"],
                               prefill_rank=pr, prefill_head_ranges=p_ranges) for pr in range(p_tp)]
        entries = land_and_unpack(plans, dst_layout, d_bufs[dr], src_slots, dst_slots, ["target.L0.K"],
                                  senders={"target.L0.K": p_ranges})
        hr = d_ranges[dr]
        assert torch.equal(d_bufs[dr]["target.L0.K"][dst_slots], full[src_slots][:, hr.start: hr.end])
        # One region per sending prefill rank: a rank that sends its whole slot writes one
        # entry for the run of positions, whatever else fills the decode slot (its heads
        # are a strided part of the prefill slot only when decode holds fewer of them).
        for plan, n in zip(plans, entries):
            whole = all(p.length == p.src.slot_bytes for p in plan.pairs)
            assert n == (len(plan.pairs) if whole else len(plan.pairs) * len(src_slots)), (plan, n)


@pytest.mark.parametrize("d_tp", [1, 2, 4])
def test_a_decode_rank_lands_only_its_feature_slice(d_tp):
    width = 12
    rows = torch.randn(SLOTS, width)
    elements = HeadRange(0, width, width)
    src = KVLayout(1, (BufferSpec("features", rows.data_ptr(), SLOTS, width * 4, elements),))
    src_slots, dst_slots = [1, 2, 3, 4], [7, 0, 5, 10]
    for rank in range(d_tp):
        part = feature_slice(width, rank, d_tp)
        dst_pool = torch.zeros(SLOTS, width)
        dst = KVLayout(1, (BufferSpec("features", dst_pool.data_ptr(), SLOTS, width * 4, elements, part),))
        regions, size = landing_regions(dst, ["features"], len(dst_slots))
        lo, hi = (part.start, part.end) if part is not None else (0, width)
        assert size == len(dst_slots) * (hi - lo) * 4  # the slice only crosses the wire and takes room
        land_and_unpack([plan_transfer(src, dst, ["features"])], dst, {"features": dst_pool}, src_slots, dst_slots,
                        ["features"])
        assert torch.equal(dst_pool[dst_slots, lo:hi], rows[src_slots, lo:hi])
        assert bool((dst_pool[:, :lo] == 0).all()) and bool((dst_pool[:, hi:] == 0).all())


def test_the_draft_buffers_land_only_with_the_draft_state_and_features_only_when_asked():
    wanted = ("target.L0.K", "target.L0.V", "draft.L0.K", "draft.L0.V", "features")
    assert landing_names(wanted, want_features=False, want_draft_state=False) == ("target.L0.K", "target.L0.V")
    assert landing_names(wanted, want_features=True, want_draft_state=False) == (
        "target.L0.K", "target.L0.V", "features")
    assert landing_names(wanted, want_features=False, want_draft_state=True) == (
        "target.L0.K", "target.L0.V", "draft.L0.K", "draft.L0.V")
    # Draft KV lands beside the target KV and unpacks into the draft pool.
    src = {**pool("target", 1, 2), **pool("draft", 1, 1)}
    dst = {**pool("target", 1, 2, fill=0.0), **pool("draft", 1, 1, fill=0.0)}
    names = list(landing_names(list(dst), False, True))
    land_and_unpack([plan_transfer(layout(src), layout(dst), wanted=names)], layout(dst), dst, [4, 5, 6], [3, 0, 9],
                    names)
    for name in names:
        assert torch.equal(dst[name][[3, 0, 9]], src[name][[4, 5, 6]]), name


def test_a_plan_that_would_write_outside_a_landing_row_is_refused():
    src = pool("target", 1, 2)
    dst = pool("target", 1, 2, fill=0.0)
    plan = plan_transfer(layout(src), layout(dst), wanted=["target.L0.K"])
    regions, _ = landing_regions(layout(dst), ["target.L0.K"], 3)
    narrow = [type(regions[0])(regions[0].name, 0, regions[0].row_bytes // 2, 0)]
    with pytest.raises(HandshakeError, match="in no region"):
        plan.landed(0, narrow, 3)


def test_pieces_are_aligned_first_fit_and_merge_back():
    area = LandingArea(8 * LANDING_ALIGN)
    a = area.take(1)
    b = area.take(LANDING_ALIGN + 1)        # two alignment units
    c = area.take(LANDING_ALIGN)
    assert (a, b, c) == (0, LANDING_ALIGN, 3 * LANDING_ALIGN)
    assert area.take(5 * LANDING_ALIGN) is None   # 4 units left
    area.give(b)
    assert area.take(2 * LANDING_ALIGN) == LANDING_ALIGN  # the hole b left, first fit
    area.give(LANDING_ALIGN)
    area.give(a)
    area.give(c)
    assert area.free_bytes == area.capacity and area.pieces == 0
    assert area.take(8 * LANDING_ALIGN) == 0      # all merged back into one extent
    with pytest.raises(KeyError):
        area.give(LANDING_ALIGN)                  # not a piece
    with pytest.raises(ValueError, match="positive"):
        area.take(0)
    with pytest.raises(ValueError, match="at least"):
        LandingArea(100)


def test_random_take_and_give_keeps_every_byte_accounted():
    rng = random.Random(0)
    area = LandingArea(64 * LANDING_ALIGN)
    out: dict[int, int] = {}
    for _ in range(3000):
        if out and rng.random() < 0.5:
            offset = rng.choice(list(out))
            area.give(offset)
            del out[offset]
        else:
            size = rng.randrange(1, 6 * LANDING_ALIGN)
            offset = area.take(size)
            if offset is not None:
                units = -(-size // LANDING_ALIGN) * LANDING_ALIGN
                assert offset % LANDING_ALIGN == 0 and offset + units <= area.capacity
                assert all(offset + units <= o or o + e <= offset for o, e in out.items()), "pieces overlap"
                out[offset] = units
        assert area.free_bytes == area.capacity - sum(out.values())
    for offset in list(out):
        area.give(offset)
    assert area.free_bytes == area.capacity and area.take(area.capacity) == 0


def test_only_scattered_reserves_land():
    assert slot_runs([]) == 0 and slot_runs([5]) == 1 and slot_runs([1, 2, 3, 7, 8]) == 2
    assert not worth_landing(list(range(100, 612)))               # one run
    assert not worth_landing(list(range(0, 64)) + list(range(200, 264)))  # runs of 64: direct is as good
    scattered = [s for i in range(100) for s in (3 * i, 3 * i + 1)]       # runs of 2
    assert worth_landing(scattered)
    assert not worth_landing(scattered, min_run=2) and worth_landing(scattered, min_run=3)
    assert not worth_landing([7])


def test_the_default_area_is_a_share_of_the_pool_within_bounds():
    assert landing_bytes(0, 1 << 40) == 0              # --disaggregation-kv-landing-mib 0: none
    assert landing_bytes(100, 1 << 20) == 100 << 20    # as given
    assert landing_bytes(None, 1 << 20) == 16 << 20    # a small pool: the floor
    assert landing_bytes(None, 8 << 30) == 256 << 20   # 1/32 of 8 GiB
    assert landing_bytes(None, 80 << 30) == 512 << 20  # the ceiling


# ---- the prefill side's gather buffer --------------------------------------------------------
from pdserve.disagg.gather import SourceGather, SourceRows  # noqa: E402


class Recorder(LocalTransfer):
    """LocalTransfer that keeps each write's entry count."""

    def __init__(self) -> None:
        super().__init__()
        self.registered: list[tuple[int, int]] = []
        self.writes: list[int] = []

    def register(self, ptr: int, length: int) -> None:
        self.registered.append((ptr, length))

    def write(self, peer_session: str, batch) -> None:
        self.writes.append(len(batch.src))
        super().write(peer_session, batch)


@pytest.mark.parametrize("gather_bytes", [1 << 20, 3 * 4 * HEAD_DIM * 4])
def test_a_strided_source_is_gathered_into_one_entry_per_pair_and_piece(gather_bytes):
    """Decode at TP2, prefill at TP1: each decode rank holds half of every prefill slot's
    heads, one entry per position when sent as planned. Gathered, each pair is one entry
    per piece of positions that fits the buffer; the bytes land where they belong."""
    kv_heads, p_tp, d_tp = 4, 1, 2
    src = {name: t for name, t in pool("target", 2, kv_heads).items()}
    p_ranges = [kv_head_range(kv_heads, 0, p_tp)]
    src_slots, dst_slots = [0, 1, 2, 3, 4, 5, 6, 7], [8, 2, 6, 1, 0, 9, 11, 3]
    sources = SourceRows()
    for t in src.values():
        sources.add(t)
    for dr in range(d_tp):
        hr = kv_head_range(kv_heads, dr, d_tp)
        dst = {name: torch.zeros(SLOTS, hr.count, HEAD_DIM) for name in src}
        dst_layout = layout(dst, heads=hr)
        plan = plan_transfer(layout(src, heads=p_ranges[0]), dst_layout, wanted=list(src), prefill_rank=0,
                             prefill_head_ranges=p_ranges)
        regions, size = landing_regions(dst_layout, list(src), len(dst_slots), {n: p_ranges for n in src})
        area = LandingArea(1 << 20)
        offset = area.take(size)
        landed = plan.landed(area.spec.ptr + offset, regions, len(dst_slots))
        assert len(landed.writes(src_slots, range(8)).src) == len(plan.pairs) * len(src_slots)  # as planned
        engine = Recorder()
        gather = SourceGather(engine, sources, nbytes=gather_bytes)
        direct, pairs = gather.split(landed, src_slots, range(8))
        assert not direct.src and len(pairs) == len(plan.pairs)
        for piece in gather.batches(pairs, src_slots, range(8)):
            engine.write("self", piece)
        per_piece = max(1, gather_bytes // sum(p.length for p in pairs))
        assert engine.writes == [len(pairs)] * -(-len(src_slots) // per_piece), engine.writes
        assert engine.registered == [(gather._buffer.data_ptr(), gather_bytes)]  # registered once, at first use
        assert gather.gathered_bytes == len(src_slots) * sum(p.length for p in pairs)
        area.unpack(offset, regions, dst_slots, dst)
        for name in src:
            assert torch.equal(dst[name][dst_slots], src[name][src_slots][:, hr.start: hr.end]), (name, dr)


def test_runs_and_unknown_memory_go_as_planned():
    src = pool("target", 1, 2)
    dst = pool("target", 1, 2, fill=0.0)
    plan = plan_transfer(layout(src), layout(dst), wanted=list(src))
    regions, size = landing_regions(layout(dst), list(src), 6)
    area = LandingArea(1 << 20)
    landed = plan.landed(area.spec.ptr, regions, 6)
    known = SourceRows()
    for t in src.values():
        known.add(t)
    engine = Recorder()
    # One run of source slots: one entry per pair already, nothing to gather.
    direct, pairs = SourceGather(engine, known).split(landed, [2, 3, 4, 5, 6, 7], range(6))
    assert not pairs and len(direct.src) == 2
    # Scattered, but the source is not memory this rank registered as host rows: as planned.
    direct, pairs = SourceGather(engine, SourceRows()).split(landed, [9, 2, 5, 0, 7, 3], range(6))
    assert not pairs and len(direct.src) == 2 * 6
    # Scattered host rows: gathered; nothing was allocated or registered before that.
    gather = SourceGather(engine, known)
    direct, pairs = gather.split(landed, [9, 2, 5, 0, 7, 3], range(6))
    assert not direct.src and len(pairs) == 2 and gather._buffer is None and not engine.registered


@pytest.mark.parametrize("kv_heads,p_tp,d_tp", [
    (h, p, d) for h, p, d in itertools.product([1, 2, 4, 8], [1, 2, 4], [1, 2, 4])])
def test_a_decode_rank_knows_when_a_prefill_rank_sends_it_part_of_its_slots(kv_heads, p_tp, d_tp):
    """Strided exactly when a sending prefill rank holds more heads than it sends (decode at
    a higher TP, with more than one KV head per prefill rank): those requests land whatever
    their slots, so the prefill rank can gather."""
    p_ranges = [kv_head_range(kv_heads, r, p_tp) for r in range(p_tp)]
    for dr in range(d_tp):
        hr = kv_head_range(kv_heads, dr, d_tp)
        dst_layout = layout({"target.L0.K": torch.zeros(SLOTS, hr.count, HEAD_DIM)}, heads=hr)
        plans = [plan_transfer(layout({"target.L0.K": torch.zeros(SLOTS, p.count, HEAD_DIM)}, heads=p), dst_layout,
                               wanted=["target.L0.K"], prefill_rank=r, prefill_head_ranges=p_ranges)
                 for r, p in enumerate(p_ranges)]
        partial = any(pair.length < pair.src.slot_bytes for plan in plans for pair in plan.pairs)
        assert strided_source(dst_layout, ["target.L0.K"], {"target.L0.K": p_ranges}) == partial
        assert not strided_source(dst_layout, ["target.L0.K"], {})  # no ranges known: as planned
