"""KV layout descriptors, the handshake compatibility record and the transfer plan.

Each side describes every buffer a request's state lives in as a named record
(``target.L17.K``, ``draft.L0.V``, ``features``...): base address, slot count,
bytes per slot and which KV heads of the model it holds.  The transfer plan is
the **join on names** of the two descriptors: a buffer is never paired by its
position in a list, so a draft layer on one side cannot shift the other side's
layers (SGLang's decode-only-draft bug that turned V caches into garbage).  A
buffer decode needs that prefill does not publish is an error at handshake
unless decode says it fills that buffer itself.

Heterogeneous tensor parallelism: a buffer's slot holds heads
[head_start, head_start + head_count) of ``total_heads``; a prefill rank sends
a decode rank the heads both hold, and when several prefill ranks hold a head
(GQA replication) only the lowest of them sends it. A decode buffer may hold more
heads than it asks for (``receives``): the target features are one full row per
slot on every rank, each decode rank receives its 1/tp slice of the row (the
"heads" there are elements) and the ranks all-gather the rest, so the wire carries
each feature once whatever decode's TP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

from pdserve.disagg.transfer import WriteBatch, coalesce

if TYPE_CHECKING:
    from pdserve.disagg.landing import LandingRegion

PROTOCOL_VERSION = 7  # 2: WritesDone acknowledges a failed room's writes; 3: TransferRequest.first_position;
#                       4: signed frames carry a MAC over their raw bytes and name their recipient;
#                       5: the draft-state hand-off (draft KV + DraftState instead of features);
#                       6: a decode TP rank receives only its slice of the features (BufferSpec.receives);
#                       7: a landing area (Handshake.landing, TransferRequest.landing_offset)


class HandshakeError(ValueError):
    """The two sides cannot work together; the message names the mismatch."""


@dataclass(frozen=True)
class HeadRange:
    start: int
    count: int
    total: int

    def __post_init__(self) -> None:
        if self.count < 1 or self.start < 0 or self.start + self.count > self.total:
            raise ValueError(f"invalid head range {self.start}+{self.count} of {self.total}")

    @property
    def end(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class BufferSpec:
    """One registered buffer: ``num_slots`` rows of ``slot_bytes`` at ``ptr``."""
    name: str
    ptr: int
    num_slots: int
    slot_bytes: int
    heads: HeadRange | None = None  # KV buffers: the heads one slot holds; None = not head-sharded
    # The heads of ``heads`` this buffer wants written by prefill (None: all of them);
    # the rest its own side fills.
    receives: HeadRange | None = None

    def __post_init__(self) -> None:
        if self.receives is not None and (self.heads is None or self.receives.total != self.heads.total
                                          or not self.heads.start <= self.receives.start
                                          or self.receives.end > self.heads.end):
            raise ValueError(f"buffer {self.name!r}: receives {self.receives} is not within its heads {self.heads}")

    @property
    def head_bytes(self) -> int:
        return self.slot_bytes // self.heads.count if self.heads is not None else self.slot_bytes

    def signature(self) -> tuple[int, int | None]:
        """What must agree between the two sides' buffers of one name: bytes per head
        (or per slot) and the model's total head count."""
        return (self.head_bytes, self.heads.total if self.heads is not None else None)


@dataclass(frozen=True)
class KVLayout:
    page_size: int
    buffers: tuple[BufferSpec, ...]

    def __post_init__(self) -> None:
        names = [b.name for b in self.buffers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate buffer names in a layout: {', '.join(dup)}")

    def by_name(self) -> dict[str, BufferSpec]:
        return {b.name: b for b in self.buffers}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.buffers)


@dataclass(frozen=True)
class CompatRecord:
    """What must agree before two servers exchange any request."""
    protocol_version: int
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    page_size: int
    vocab_size: int
    speculative_algorithm: str | None = None  # None: no draft model on this side
    feature_width: int = 0                    # per-position target feature a draft reads (0: none)
    tp_size: int = 1
    extra: tuple[tuple[str, str], ...] = field(default=())
    # The draft head's fingerprint ("" without one) and top-k: two sides with the same
    # draft and top-k hand over the draft's state (draft KV + DraftState) instead of features.
    draft_identity: str = ""
    eagle_topk: int = 0
    # fp8 KV: the per-layer scales' digest (KVScales.digest). The bytes sent are only
    # meaningful under the sender's scales, and two model paths may ship different ones.
    kv_scales: str = "1.0"

    def shares_draft_with(self, other: "CompatRecord") -> bool:
        """Whether a request prefilled on one side may start decoding on the other from
        the draft state the first computed (the same head, the same top-k)."""
        return bool(self.draft_identity) and (self.draft_identity, self.eagle_topk) == (
            other.draft_identity, other.eagle_topk)

    def mismatches(self, other: "CompatRecord") -> list[str]:
        """Fields that make the pair unusable, as 'field: mine vs theirs' (empty = fine).
        Speculative settings may differ (a plain side pairs with a speculative one);
        two speculative sides must run the same algorithm and width."""
        out = []
        for name in ("protocol_version", "architecture", "num_layers", "num_kv_heads", "head_dim", "kv_dtype",
                     "kv_scales", "page_size", "vocab_size"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name}: {a} vs {b}" + (" (pdserve releases with different PD protocols: run the "
                                                     "same release on both sides)" if name == "protocol_version"
                                                     else ""))
        if self.speculative_algorithm and other.speculative_algorithm:
            if self.speculative_algorithm != other.speculative_algorithm:
                out.append(f"speculative_algorithm: {self.speculative_algorithm} vs {other.speculative_algorithm}")
            elif self.feature_width != other.feature_width:
                out.append(f"feature_width: {self.feature_width} vs {other.feature_width}")
        return out


def check_compatible(prefill: CompatRecord, decode: CompatRecord) -> None:
    bad = prefill.mismatches(decode)
    if bad:
        raise HandshakeError("prefill and decode servers are incompatible (prefill vs decode): " + "; ".join(bad))


def kv_head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> HeadRange:
    """The KV heads a TP rank holds (the engine's QKV sharding: split when there are at
    least as many heads as ranks, else each rank keeps the one head its queries use)."""
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return HeadRange(tp_rank * per, per, num_kv_heads)
    return HeadRange(tp_rank // (tp_size // num_kv_heads), 1, num_kv_heads)


def feature_slice(width: int, tp_rank: int, tp_size: int) -> HeadRange | None:
    """The elements of a feature row a decode TP rank receives: its 1/tp of them (the
    ranks all-gather the rest); None when the row does not split evenly (every rank
    receives the whole row)."""
    if tp_size == 1 or width % tp_size:
        return None
    per = width // tp_size
    return HeadRange(tp_rank * per, per, width)


def sender_heads(prefill_ranges: Sequence[HeadRange], prefill_rank: int, dst: HeadRange) -> HeadRange | None:
    """The heads of ``dst`` that prefill rank ``prefill_rank`` must send: those it
    holds that no lower prefill rank holds. Ranges are contiguous, so the result is."""
    mine = prefill_ranges[prefill_rank]
    lo, hi = max(mine.start, dst.start), min(mine.end, dst.end)
    covered = [r for r in prefill_ranges[:prefill_rank]]
    heads = [h for h in range(lo, hi) if not any(r.start <= h < r.end for r in covered)]
    if not heads:
        return None
    assert heads == list(range(heads[0], heads[-1] + 1)), "head ranges must be contiguous"
    return HeadRange(heads[0], len(heads), dst.total)


@dataclass(frozen=True)
class BufferPair:
    src: BufferSpec
    dst: BufferSpec
    src_offset: int   # bytes into a source slot
    dst_offset: int   # bytes into a destination slot
    length: int       # bytes per slot to move

    @property
    def whole_slots(self) -> bool:
        return self.length == self.src.slot_bytes == self.dst.slot_bytes


@dataclass(frozen=True)
class TransferPlan:
    pairs: tuple[BufferPair, ...]

    def writes(self, src_slots: Sequence[int], dst_slots: Sequence[int]) -> WriteBatch:
        """The writes that move the given slots (position i of one to position i of the
        other) through every paired buffer; contiguous runs become one entry."""
        if len(src_slots) != len(dst_slots):
            raise ValueError(f"{len(src_slots)} source slots but {len(dst_slots)} destination slots")
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        for p in self.pairs:
            s_addr = [p.src.ptr + s * p.src.slot_bytes + p.src_offset for s in src_slots]
            d_addr = [p.dst.ptr + d * p.dst.slot_bytes + p.dst_offset for d in dst_slots]
            if p.whole_slots:
                part = coalesce(s_addr, d_addr, p.length)
            else:
                part = WriteBatch(tuple(s_addr), tuple(d_addr), (p.length,) * len(s_addr))
            srcs += part.src
            dsts += part.dst
            lens += part.lengths
        return WriteBatch(tuple(srcs), tuple(dsts), tuple(lens))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.dst.name for p in self.pairs)

    def landed(self, base: int, regions: Sequence["LandingRegion"], positions: int) -> "TransferPlan":
        """This plan writing into a landing piece at address ``base`` (``landing.py``)
        instead of decode's slots: destination "slot" i is the piece's row of position i
        in the region holding the pair's bytes, so consecutive positions are consecutive
        there (HandshakeError when no region holds them)."""
        pairs = []
        for p in self.pairs:
            r = next((r for r in regions if r.name == p.dst.name and r.skip <= p.dst_offset
                      and p.dst_offset + p.length <= r.skip + r.row_bytes), None)
            if r is None:
                raise HandshakeError(f"buffer {p.dst.name!r}: bytes {p.dst_offset}+{p.length} of a slot are in no "
                                     "region of the landing piece")
            dst = BufferSpec(p.dst.name, base + r.offset, positions, r.row_bytes)
            pairs.append(BufferPair(p.src, dst, p.src_offset, p.dst_offset - r.skip, p.length))
        return TransferPlan(tuple(pairs))


def plan_transfer(src: KVLayout, dst: KVLayout, wanted: Iterable[str], prefill_rank: int = 0,
                  prefill_head_ranges: Sequence[HeadRange] | None = None) -> TransferPlan:
    """Join the layouts on buffer names for the buffers decode ``wanted``.

    Every wanted name must exist on both sides with the same bytes per head; a
    head-sharded buffer moves the heads this prefill rank owes the decode rank.
    """
    if src.page_size != dst.page_size:
        raise HandshakeError(f"page_size: prefill {src.page_size} vs decode {dst.page_size}")
    have, need = src.by_name(), dst.by_name()
    pairs = []
    for name in wanted:
        if name not in need:
            raise HandshakeError(f"decode asks for buffer {name!r} but does not publish it")
        if name not in have:
            raise HandshakeError(f"decode needs buffer {name!r} that prefill does not have "
                                 f"(prefill publishes: {', '.join(src.names)})")
        s, d = have[name], need[name]
        if s.signature() != d.signature():
            raise HandshakeError(f"buffer {name!r}: prefill has {s.signature()} (bytes per head, heads), "
                                 f"decode {d.signature()}")
        if s.heads is None or d.heads is None:
            pairs.append(BufferPair(s, d, 0, 0, s.slot_bytes))
            continue
        ranges = list(prefill_head_ranges) if prefill_head_ranges is not None else [s.heads]
        sent = sender_heads(ranges, prefill_rank if prefill_head_ranges is not None else 0, d.receives or d.heads)
        if sent is None:
            continue
        hb = s.head_bytes
        pairs.append(BufferPair(s, d, (sent.start - s.heads.start) * hb, (sent.start - d.heads.start) * hb,
                                sent.count * hb))
    return TransferPlan(tuple(pairs))
