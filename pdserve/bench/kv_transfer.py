"""KV transfer throughput: each transfer engine (Mooncake, NIXL) through pdserve's
transfer plan vs a raw loopback TCP socket moving the same bytes, between two processes;
contiguous, realistically scattered and fully shuffled.

    python -m pdserve.bench.kv_transfer --engines mooncake nixl --sizes-mib 1 16 64 256

Part 1, GB/s. For each engine, model shape and request size (``--sizes-mib``: the prompt
length whose KV is that many MiB; ``--tokens``: prompt lengths as such), a receiver
process registers a per-layer K/V pool like a decode server's (``--pool-factor`` times
the request, at least 1024 slots) and the sender (this process) one like a prefill
server's; fresh engines on both sides per case, the receiver's metadata loaded by the
sender (``add_peer``) as the bootstrap handshake does. The sender then writes one
request's KV through the plan (``plan_transfer(...).writes``: runs of consecutive slots on
both sides become one entry per buffer) as:

- contiguous: slots 0..n-1 on both sides (one entry per buffer). Where the engine splits
  entries itself (``max_entry_bytes``; Mooncake's TCP transport is faster with ~512 KiB
  pieces), also with ``max_entry_bytes = None`` ("unsplit", the before);
- scattered realistically, at each ``--page-sizes``: the slots a request gets on a pool
  after churn (``churn_slots``: the real ``PageAllocator`` on each side, prefill and decode
  independently), with the allocator's stack policy everywhere ("stack", the old
  allocator) and, where the allocator has ``alloc_ids(n, contiguous=...)``, with runs for
  prompt chunks and reserves ("extent"); each with its average run length (tokens per
  joint run of consecutive slots on both sides). Both sides are churned as a decode
  server's pool there (background requests decode); where the allocator has the extent
  policy, also role-true ("pd"): the source churned as a prefill server's pool (requests
  leave once their prompt is in: no decode steps), the destination as extent's reserve;
- landed, at each page size with the extent policy: pd's slots moved the way pdserve
  moves a request whose decode slots are scattered (``pdserve.disagg.landing``): the
  receiver owns a registered landing area (published with its layout), the sender writes
  the request packed in a piece of it (``plan.landed(...).writes``: one entry per source
  run and buffer) and the time includes the receiver's ``unpack`` into the slots (asked
  over the pipe, so a little more than decode pays); tokens/run counts source runs;
- fully shuffled: page size 1, the destination slots a random permutation (the worst
  case: one entry per token per buffer).

The raw socket sends the same bytes from the same buffers (``sendall`` per buffer on one
connection, ``recv_into`` one sink, a one-byte acknowledgement per message), measured
first in each case, before either side has an engine (NIXL's UCX progress thread polls:
on a small machine it would take CPU from the socket; the engines' writes run with their
threads, as in a server). Each figure is the best of at least ``--repeats`` writes after
one warm-up write (the first write to a peer includes its connection); a fast write is
repeated for 0.3 s (at most 100 times), and no new write starts once a pattern has taken
``--pattern-seconds``. Every pattern written whole is checked on the receiver: its
destination slots, blanked before, hold the sender's values in every buffer (landed:
after the unpack, from a piece blanked before). A batch of
more than ``--max-entries`` entries is timed on its first ``--max-entries`` entries
(marked ``*``): per-entry cost dominates there, so the prefix's GB/s is the whole batch's,
and Mooncake needs ~20 s for half a million 512-byte entries. Memory: about
``2 * --pool-factor + 1`` times the largest request (the landing area holds one), split
between the two processes.

With ``--decode-tp N`` (N > 1) part 1 measures instead the tensor-parallel mismatch: a TP1
prefill rank sending decode rank 0 at TP N, which holds ``kv_heads / N`` heads of each slot
(``kv_head_range``), on contiguous slots on both sides (``measure_tp_case``): "tp direct"
writes the plan into the rank's slots (a strided part of every source slot: one entry per
position and buffer, whatever the page size), "tp gathered" as pdserve sends it (the
prefill rank's ``SourceGather`` copies the rows into its registered buffer and writes one
entry per buffer and piece into the rank's landing piece, which the receiver unpacks; all
timed). Each as GB/s of the bytes the rank receives and against the raw socket moving as
many, in a table of its own; both checked on the receiver, every head of every slot coded
(``head_codes``), so a wrong head or position shows.

Part 2, TTFT split (``--ttft-engine``): a prefill and a decode scheduler (each with its
own engine over loopback TCP, in one process) serve one long prompt at a time; the time to
the first token on decode is split into prefill (room setup + compute, KV of chunk i
written while chunk i+1 computes), the transfer tail (the writes still running when the
first token is drawn, plus the handoff record) and decode commit (admitting the request
with its first token); the colocated scheduler's TTFT on the same prompt is the reference.
"""

from __future__ import annotations

import argparse
import inspect
import math
import multiprocessing as mp
import os
import random
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from pdserve.config import PD_PAGE_SIZE
from pdserve.disagg.gather import GATHER_BYTES, SourceGather, SourceRows
from pdserve.disagg.landing import LANDING_ALIGN, LandingArea, LandingRegion, landing_regions, slot_runs
from pdserve.disagg.layout import BufferSpec, HeadRange, KVLayout, kv_head_range, plan_transfer
from pdserve.disagg.transfer import WriteBatch
from pdserve.scheduler.kv_manager import pages_for
from pdserve.scheduler.memory import PageAllocator

HOST = "127.0.0.1"
ENGINES = ("mooncake", "nixl")


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token (K and V of every layer, float32)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * 4

    def tokens_for(self, mib: float) -> int:
        """The prompt length whose KV is ``mib`` MiB (at least one token)."""
        return max(1, round(mib * 2**20 / self.token_bytes))

    def buffers(self, slots: int, blank: bool = False, heads: int | None = None) -> dict[str, torch.Tensor]:
        """The per-layer K/V buffers (``heads`` KV heads a slot, default all): the sender's
        hold ``FILL[name]`` everywhere, a receiver's (``blank``) ``BLANK``. Written either
        way: calloc'd pages would map the shared zero page, and each page's first write
        would fault inside a timed write."""
        count = self.kv_heads if heads is None else heads
        return {name: torch.empty(slots, count, self.head_dim).fill_(BLANK if blank else FILL[name])
                for name in self.names}

    @property
    def all_heads(self) -> HeadRange:
        """The heads a TP1 server's slot holds."""
        return HeadRange(0, self.kv_heads, self.kv_heads)

    def decode_heads(self, decode_tp: int) -> HeadRange:
        """The heads decode rank 0 holds at TP ``decode_tp`` (the server's sharding)."""
        return kv_head_range(self.kv_heads, 0, decode_tp)

    @property
    def names(self) -> list[str]:
        return [f"target.L{i}.{kind}" for i in range(self.layers) for kind in ("K", "V")]


# The sender's value in each buffer (distinct per buffer: a write into the wrong buffer shows)
# and a receiver's before a pattern is written.
FILL = {f"target.L{i}.{kind}": float(2 * i + (kind == "V") + 1) for i in range(64) for kind in ("K", "V")}
BLANK = -1.0

SHAPES = {"demo": Shape("demo (4 layers, 4x32 KV)", 4, 4, 32),
          "wide": Shape("wide (16 layers, 8x128 KV)", 16, 8, 128)}


def layout_of(bufs: dict[str, torch.Tensor], heads: HeadRange | None = None) -> KVLayout:
    """The layout of ``bufs``; ``heads``: the KV heads each slot holds (head-sharded
    buffers, as a TP server publishes them), None: not head-sharded."""
    return KVLayout(1, tuple(BufferSpec(n, t.data_ptr(), t.shape[0], t[0].numel() * t.element_size(), heads)
                             for n, t in bufs.items()))


# ---- decode at a higher TP than prefill: what the byte check compares --------------------

# Head and slot bits of a code (below): the shapes' KV heads and the largest pool fit.
_HEAD_BITS, _SLOT_BITS = 4, 20


def head_codes(name: str, heads: HeadRange, slots: torch.Tensor) -> torch.Tensor:
    """The int32 every element of head h of slot s of buffer ``name`` holds on the sender
    of a --decode-tp case, for ``heads`` and ``slots``: shape (len(slots), heads.count, 1).
    The buffer, the head and the slot are all in it, so a row in the wrong slot, a head at
    the wrong offset (strided writes are what this case measures) or a buffer mixed up
    with another fails the receiver's check, where one value per buffer (FILL) would not."""
    if heads.total > 1 << _HEAD_BITS:
        raise ValueError(f"head codes hold at most {1 << _HEAD_BITS} KV heads, not {heads.total}")
    h = torch.arange(heads.start, heads.end, dtype=torch.int32).view(1, -1, 1)
    s = (slots.to(torch.int32) % (1 << _SLOT_BITS)).view(-1, 1, 1)
    # FILL's values are 1..128: code 0..127 in the top bits keeps every code positive, so
    # none is BLANK's bit pattern (a negative int32).
    return ((int(FILL[name]) - 1) << (_HEAD_BITS + _SLOT_BITS)) + (h << _SLOT_BITS) + s


def coded_buffers(shape: Shape, slots: int) -> dict[str, torch.Tensor]:
    """The sender's buffers of a --decode-tp case: every head of every slot holds its
    ``head_codes`` (float32 storage written as int32: the transfers copy bytes)."""
    out = {}
    index = torch.arange(slots)
    for name in shape.names:
        t = torch.empty(slots, shape.kv_heads, shape.head_dim)
        t.view(torch.int32)[:] = head_codes(name, shape.all_heads, index)
        out[name] = t
    return out


# ---- realistic scatter: a churned pool ------------------------------------------------------

@dataclass(frozen=True)
class Churn:
    """The workload ``churn_slots`` runs on a pool before it allocates the measured request."""
    pool_factor: float = 4.0   # pool size in tokens: this many times the measured request ...
    min_pool_tokens: int = 1024  # ... and at least this many
    fill: float = 0.9          # requests are admitted while the pool is under this fraction
    steps: int = 300           # decode steps after the pool first reached ``fill``
    chunk: int = 512           # prefill chunk (tokens) a prompt is allocated in
    min_prompt: int = 16       # background prompts: log-uniform in [min_prompt, max(4 * min_prompt,
    #                            the measured request)] tokens
    max_output: int = 256      # background outputs: uniform in [1, max_output] tokens
    # Whether the background requests decode after their prompt (a decode or colocated
    # server's pool: every step grows each of them by a token). False: a prefill server's
    # pool, where a request leaves once its prompt is computed and sent (its first token
    # is decode's business): each step one random request leaves (transfers to different
    # decode servers end in any order) and no page is ever taken one at a time.
    decodes: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.decodes, bool):
            raise ValueError(f"Churn.decodes must be True or False, got {self.decodes!r}")
        for name in ("min_pool_tokens", "steps", "chunk", "min_prompt", "max_output"):
            if getattr(self, name) < 1:
                raise ValueError(f"Churn.{name} must be at least 1, got {getattr(self, name)}")
        if self.pool_factor < 1.5:
            raise ValueError(f"Churn.pool_factor must be at least 1.5, got {self.pool_factor}")
        if not 0 < self.fill < 1:
            raise ValueError(f"Churn.fill must be in (0, 1), got {self.fill}")

    def pool_tokens(self, tokens: int) -> int:
        return max(math.ceil(self.pool_factor * tokens), self.min_pool_tokens, tokens + self.chunk)


def has_extent_policy(allocator_cls: type = PageAllocator) -> bool:
    """Whether ``allocator_cls.alloc_ids`` takes ``contiguous`` (the runs policy)."""
    return "contiguous" in inspect.signature(allocator_cls.alloc_ids).parameters


def pool_slots(tokens: int, page_sizes: Sequence[int], churn: Churn) -> int:
    """Slots a buffer needs to hold the pool ``churn_slots`` uses at every page size."""
    pool = churn.pool_tokens(tokens)
    return max((pages_for(pool, ps) + 1) * ps for ps in page_sizes)


@dataclass
class _SimReq:
    prompt: int
    output: int
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0


def churn_slots(tokens: int, page_size: int, *, seed: int, extent: bool, reserve: bool = False,
                churn: Churn = Churn(), allocator_cls: type = PageAllocator) -> list[int]:
    """The KV slots (``page * page_size + offset``, position order) a request of ``tokens``
    tokens gets on a pool that has been serving, simulated with the allocator's own code.

    The pool holds ``churn.pool_tokens(tokens)`` tokens in pages of ``page_size`` (plus the
    padding page 0). Each step admits requests of random lengths while the pool is under
    ``churn.fill`` (their prompts allocated in chunks of ``churn.chunk`` tokens, one
    allocation per chunk), then grows every decoding request by one token: the requests
    that need a page get them in one ``alloc_ids(k)`` for all (the scheduler's decode
    step), which interleaves the live requests' pages; a request that reached its output
    length is released (random lengths: random requests finish), and when a decode step
    finds no free page a random request is retracted. After ``churn.steps`` steps past
    the first time the pool reached ``fill``, random requests are released until the
    measured one fits, which is then allocated in prompt chunks (a prefill server) or, with
    ``reserve``, in one allocation (a decode server's PD reserve). With ``churn.decodes``
    False (a prefill server's pool) a step admits, then releases one random request: no
    decode growth at all.

    ``extent``: prompt chunks and the reserve ask the allocator for runs
    (``alloc_ids(n, contiguous=True)``; decode growth never does); ValueError when
    ``allocator_cls`` has no such policy. Deterministic for a ``seed``.
    """
    if tokens < 1 or page_size < 1:
        raise ValueError(f"churn_slots needs tokens >= 1 and page_size >= 1 (got {tokens}, {page_size})")
    if extent and not has_extent_policy(allocator_cls):
        raise ValueError(f"{allocator_cls.__name__}.alloc_ids has no `contiguous` policy: no extent allocation")
    ps = page_size
    alloc = allocator_cls(pages_for(churn.pool_tokens(tokens), ps) + 1, ps)
    runs = {"contiguous": True} if extent else {}
    rng = random.Random(seed)
    hi = max(4 * churn.min_prompt, tokens)
    live: list[_SimReq] = []

    def grow(req: _SimReq, new_len: int, **kw: bool) -> None:
        req.pages += alloc.alloc_ids(pages_for(new_len, ps) - len(req.pages), **kw)
        req.kv_len = new_len

    def release(req: _SimReq) -> None:
        live.remove(req)
        alloc.release(torch.tensor(req.pages, dtype=torch.int64))

    def admit() -> None:
        while True:
            prompt = round(math.exp(rng.uniform(math.log(churn.min_prompt), math.log(hi))))
            need = pages_for(prompt, ps)
            if alloc.capacity - alloc.num_free + need > churn.fill * alloc.capacity:
                return
            req = _SimReq(prompt, rng.randint(1, churn.max_output))
            live.append(req)
            for start in range(0, prompt, churn.chunk):
                grow(req, min(start + churn.chunk, prompt), **runs)

    def decode_step() -> None:
        decoding = [r for r in live if r.kv_len - r.prompt < r.output]
        needy = [r for r in decoding if r.kv_len % ps == 0]
        while len(needy) > alloc.num_free:  # no room for this step: retract a random request
            victim = rng.choice(live)
            release(victim)
            decoding = [r for r in decoding if r is not victim]
            needy = [r for r in needy if r is not victim]
        new = iter(alloc.alloc_ids(len(needy)))
        for r in decoding:
            if r.kv_len % ps == 0:
                r.pages.append(next(new))
            r.kv_len += 1
        for r in [r for r in live if r.kv_len - r.prompt >= r.output]:
            release(r)

    filled, step, warm, warm_cap = False, 0, 0, 10 * churn.steps
    while step < churn.steps:
        admit()
        filled = filled or alloc.capacity - alloc.num_free >= churn.fill * alloc.capacity * 0.97
        if churn.decodes:
            decode_step()
        elif live:  # a prefill server: a request whose prompt is done and sent leaves
            release(rng.choice(live))
        warm += 1
        if filled or warm > warm_cap:  # (a pool that never quite reaches ``fill`` churns all the same)
            step += 1
    need = pages_for(tokens, ps)
    while alloc.num_free < need:
        release(rng.choice(live))
    req = _SimReq(tokens, 0)
    if reserve:
        grow(req, tokens, **runs)
    else:
        for start in range(0, tokens, churn.chunk):
            grow(req, min(start + churn.chunk, tokens), **runs)
    return [req.pages[i // ps] * ps + i % ps for i in range(tokens)]


def joint_runs(src: Sequence[int], dst: Sequence[int]) -> int:
    """Runs of positions whose slots are consecutive on both sides (one write entry per
    buffer each: what ``TransferPlan.writes`` coalesces)."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source slots but {len(dst)} destination slots")
    if not src:
        return 0
    return 1 + sum(1 for i in range(1, len(src)) if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1)


def run_length(src: Sequence[int], dst: Sequence[int]) -> float:
    """Average tokens per joint run (``joint_runs``)."""
    return len(src) / joint_runs(src, dst) if src else 0.0


# ---- the cases a run measures --------------------------------------------------------------

@dataclass(frozen=True)
class Pattern:
    """One way of placing the request's slots: its column and its slots on each side."""
    key: str            # "contiguous", "shuffle", "stack p1", "extent p16", "pd p1", "landed p1", ...
    src: tuple[int, ...]
    dst: tuple[int, ...]
    # Written into the receiver's landing area (position i at row i), then unpacked into
    # ``dst`` by the receiver: how pdserve moves a request whose decode slots are scattered.
    landed: bool = False

    @property
    def tokens_per_run(self) -> float:
        """Tokens per write entry and buffer: runs consecutive on both sides, or, landed,
        on the source side only (the landing piece is consecutive)."""
        if self.landed:
            return len(self.src) / slot_runs(self.src) if self.src else 0.0
        return run_length(self.src, self.dst)


def prefill_server(churn: Churn) -> Churn:
    """``churn`` as a prefill server's pool sees it: the same pool and prompts, no decode."""
    return replace(churn, decodes=False)


def patterns(tokens: int, page_sizes: Sequence[int], seed: int, churn: Churn,
             allocator_cls: type = PageAllocator) -> list[Pattern]:
    """Every pattern of one request size but "unsplit" (which is "contiguous" measured
    differently); the scatters come from ``churn_slots`` with the prefill side's seed
    ``seed`` and the decode side's ``seed + 1``, the same for both policies.

    "stack pN" and "extent pN" churn both sides as a decode server's pool (the bench's
    first measure, kept as it was). Where the allocator has the extent policy, "pd pN"
    churns each side as its role does: the source as a prefill server's pool
    (``prefill_server``), the destination as a decode server's reserve (extent pN's), and
    "landed pN" moves the same slots through the receiver's landing area."""
    contiguous = tuple(range(tokens))
    shuffled = list(contiguous)
    random.Random(seed).shuffle(shuffled)
    out = [Pattern("contiguous", contiguous, contiguous), Pattern("shuffle", contiguous, tuple(shuffled))]
    policies = ("stack", "extent") if has_extent_policy(allocator_cls) else ("stack",)
    for ps in page_sizes:
        for policy in policies:
            kw = dict(extent=policy == "extent", churn=churn, allocator_cls=allocator_cls)
            src = churn_slots(tokens, ps, seed=seed, **kw)
            dst = churn_slots(tokens, ps, seed=seed + 1, reserve=True, **kw)
            out.append(Pattern(f"{policy} p{ps}", tuple(src), tuple(dst)))
            if policy == "extent":
                src = churn_slots(tokens, ps, seed=seed, extent=True, churn=prefill_server(churn),
                                  allocator_cls=allocator_cls)
                out.append(Pattern(f"pd p{ps}", tuple(src), tuple(dst)))
                out.append(Pattern(f"landed p{ps}", tuple(src), tuple(dst), landed=True))
    return out


@dataclass(frozen=True)
class Rate:
    """One measured pattern: GB/s, the plan's entries, how many of them were timed."""
    gbps: float
    entries: int
    timed_entries: int
    tokens_per_run: float | None = None  # scatters only
    wire_entries: int | None = None      # contiguous with an engine that splits entries


@dataclass
class CaseResult:
    engine: str
    shape: str
    tokens: int
    nbytes: int
    raw: float
    rates: dict[str, Rate | None]  # None: not measurable here (n/a)


# ---- the receiver process -------------------------------------------------------------------

def _recv_exactly(sock: socket.socket, view: memoryview) -> memoryview | None:
    """Fill ``view`` from ``sock``; None when the peer closed first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return view


def _receiver(engine_name: str, conn: Any, nixl_progress_delay_us: int | None = None) -> None:
    """Serves ("setup", shape, slots, landing_positions, decode_tp) -> (session, metadata,
    layout, landing area's spec or None), ("raw",) -> the bytes received on one raw socket
    connection (see below), ("clear", slots), ("check", slots) -> the buffers not holding
    the sender's values there, ("check_heads", slots, src_slots) -> the same for a
    --decode-tp case (``head_codes``), ("land", slots) -> the offset of a blanked landing
    piece for a request with those slots, ("unpack",) -> None once that piece is copied into
    them, ("close",) -> None; ends on None or when the parent is gone. Ends with os._exit: a
    process that created a UCX backend must not run interpreter exit."""
    from pdserve.disagg.engines import make_transfer_engine

    set_nixl_progress_delay(nixl_progress_delay_us)
    engine = None
    bufs: dict[str, torch.Tensor] = {}
    # The case's heads per slot (decode rank 0's at its TP; None: all, not head-sharded) and
    # every prefill rank's heads of each buffer (one TP1 rank), as the landing piece is cut.
    heads: HeadRange | None = None
    senders: dict[str, list[HeadRange]] | None = None
    # The case's landing area, as a decode rank owns one, and the piece ``land`` took.
    area: LandingArea | None = None
    landing: tuple[int, tuple[LandingRegion, ...], list[int]] | None = None  # (offset, regions, slots)
    server = socket.create_server((HOST, 0))
    sink = bytearray()
    try:
        conn.send(server.getsockname()[1])
        while True:
            try:
                cmd = conn.recv()
            except EOFError:
                break
            if cmd is None:
                break
            if cmd[0] == "setup":
                _, key, slots, landing_positions, decode_tp = cmd
                shape = SHAPES[key]
                engine = make_transfer_engine(engine_name, host=HOST)
                heads = shape.decode_heads(decode_tp) if decode_tp > 1 else None
                senders = {n: [shape.all_heads] for n in shape.names} if heads is not None else None
                bufs = shape.buffers(slots, blank=True, heads=heads.count if heads is not None else None)
                for t in bufs.values():
                    engine.register(t.data_ptr(), t.numel() * t.element_size())
                layout = layout_of(bufs, heads)
                area, landing = None, None
                if landing_positions:  # room for one request of that many positions (all buffers)
                    _, size = landing_regions(layout, layout.names, landing_positions, senders)
                    area = LandingArea(max(size, LANDING_ALIGN))
                    engine.register(area.spec.ptr, area.capacity)
                conn.send((engine.session_id, engine.metadata(), layout, area.spec if area is not None else None))
            elif cmd[0] == "raw":
                # One connection per case; on it, messages of an 8-byte length and that many
                # bytes, each acknowledged with one byte, until the sender closes it.
                peer, _ = server.accept()
                total = 0
                with peer:
                    while True:
                        head = _recv_exactly(peer, memoryview(bytearray(8)))
                        if head is None:
                            break
                        nbytes = int.from_bytes(head, "little")
                        if len(sink) < nbytes:
                            sink = bytearray(nbytes)
                        if _recv_exactly(peer, memoryview(sink)[:nbytes]) is None:
                            break
                        total += nbytes
                        peer.sendall(b"k")
                conn.send(total)
            elif cmd[0] == "clear":
                index = torch.tensor(cmd[1], dtype=torch.int64)
                for t in bufs.values():
                    t[index] = BLANK
                conn.send(None)
            elif cmd[0] == "check":
                index = torch.tensor(cmd[1], dtype=torch.int64)
                conn.send(sorted(n for n, t in bufs.items() if not bool((t[index] == FILL[n]).all())))
            elif cmd[0] == "check_heads":
                if heads is None:
                    raise RuntimeError("check_heads: this case's setup has no --decode-tp")
                index, src = (torch.tensor(c, dtype=torch.int64) for c in cmd[1:])
                conn.send(sorted(n for n, t in bufs.items()
                                 if not bool((t.view(torch.int32)[index] == head_codes(n, heads, src)).all())))
            elif cmd[0] == "land":
                # As decode admits a request with scattered slots: a piece of its landing area
                # (blanked, so that a write that did not come leaves no earlier pattern's rows).
                if area is None:
                    raise RuntimeError("land: this case's setup asked for no landing area")
                if landing is not None:
                    area.give(landing[0])
                layout = layout_of(bufs, heads)
                regions, size = landing_regions(layout, layout.names, len(cmd[1]), senders)
                offset = area.take(size)
                if offset is None:
                    raise RuntimeError(f"land: {len(cmd[1])} positions ({size} bytes) do not fit the "
                                       f"{area.capacity}-byte landing area")
                area.buffer[offset: offset + size] = 0
                landing = (offset, regions, list(cmd[1]))
                conn.send(offset)
            elif cmd[0] == "unpack":
                # As decode commits a landed request: its rows into its slots.
                if area is None or landing is None:
                    raise RuntimeError("unpack before land")
                area.unpack(landing[0], landing[1], landing[2], bufs)
                conn.send(None)
            elif cmd[0] == "close":
                if engine is not None:
                    engine.close()
                engine, bufs, area, landing, heads, senders = None, {}, None, None, None, None
                conn.send(None)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if engine is not None:
        engine.close()
    os._exit(0)


def set_nixl_progress_delay(delay_us: int | None) -> None:
    """NIXL engines made from now on in this process pause ``delay_us`` between their
    progress thread's polls (None: pdserve's default)."""
    if delay_us is not None:
        from pdserve.disagg.nixl_engine import NixlTransfer

        NixlTransfer.PROGRESS_DELAY_US = delay_us


def _refuse_wrong(wrong: Sequence[str], what: str) -> None:
    """RuntimeError naming the buffers (``wrong``) whose written slots do not hold ``what``."""
    if wrong:
        raise RuntimeError(f"the written slots do not hold {what} in {', '.join(wrong[:4])}"
                           + (f" and {len(wrong) - 4} more buffers" if len(wrong) > 4 else ""))


class Receiver:
    """The receiving process of one engine, kept for the whole run."""

    def __init__(self, engine_name: str, nixl_progress_delay_us: int | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_receiver, args=(engine_name, child, nixl_progress_delay_us), daemon=True)
        self._proc.start()
        child.close()
        self.port = self._ask(None)

    def _ask(self, cmd: Any) -> Any:
        if cmd is not None:
            self._conn.send(cmd)
        if not self._conn.poll(300):
            raise RuntimeError("the receiver process did not answer within 300 s")
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the receiver process died (exit status {self._proc.exitcode})") from None

    def setup(self, shape: str, slots: int, landing_positions: int = 0, decode_tp: int = 1
              ) -> tuple[str, str, KVLayout, BufferSpec | None]:
        """A fresh engine and ``slots`` blank slots of every buffer of ``shape``, all
        registered; with ``landing_positions``, also a landing area holding a request of
        that many positions. ``decode_tp`` > 1: the buffers are decode rank 0's at that TP
        (its heads of each slot, published head-sharded) and a landing piece is cut for one
        TP1 prefill rank. Its session, metadata, layout and landing area (None without)."""
        return self._ask(("setup", shape, slots, landing_positions, decode_tp))

    def raw(self) -> socket.socket:
        """A connection to the receiver's raw socket (send ``raw_message``s on it; close it
        and call ``raw_done``)."""
        self._conn.send(("raw",))
        return socket.create_connection((HOST, self.port))

    def raw_done(self) -> int:
        """The bytes the raw socket connection delivered."""
        return self._ask(None)

    def clear(self, slots: Sequence[int]) -> None:
        """Blank ``slots`` of every buffer (so that ``check`` sees the next pattern's writes)."""
        self._ask(("clear", list(slots)))

    def check(self, slots: Sequence[int]) -> None:
        """RuntimeError unless every buffer holds the sender's values at ``slots``."""
        _refuse_wrong(self._ask(("check", list(slots))), "the sender's values")

    def check_heads(self, slots: Sequence[int], src: Sequence[int]) -> None:
        """RuntimeError unless, in a --decode-tp case, every buffer holds at ``slots`` the
        sender's ``head_codes`` of ``src`` (position by position) for this rank's heads."""
        _refuse_wrong(self._ask(("check_heads", list(slots), list(src))), "this decode rank's heads of the sender's "
                      "values")

    def land(self, slots: Sequence[int]) -> int:
        """Take (and blank) a landing piece for a request with destination ``slots``, as
        decode's admission does; its offset in the landing area."""
        return self._ask(("land", list(slots)))

    def unpack(self) -> None:
        """Copy the landed piece into its slots, as decode's commit does."""
        self._ask(("unpack",))

    def close_case(self) -> None:
        self._ask(("close",))

    def stop(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


# ---- measuring ----------------------------------------------------------------------------

def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# A fast write is repeated for at least this long (up to MAX_RUNS runs): on a shared
# machine a millisecond write's best of 3 is mostly scheduling noise.
MIN_SECONDS = 0.3
MAX_RUNS = 100


def best_time(fn: Callable[[], None], repeats: int, budget_s: float, min_s: float = MIN_SECONDS,
              max_runs: int = MAX_RUNS) -> float:
    """The shortest run of ``fn``: at least ``repeats`` runs, more while under ``min_s``
    seconds in all (at most ``max_runs``); no new run once ``budget_s`` is spent."""
    start, best, runs = time.perf_counter(), math.inf, 0
    while True:
        best = min(best, _timed(fn))
        runs += 1
        spent = time.perf_counter() - start
        if spent >= budget_s or (runs >= repeats and (spent >= min_s or runs >= max_runs)):
            return best


def wire_entries(batch: WriteBatch, max_entry_bytes: int | None) -> int:
    """Entries an engine that splits at ``max_entry_bytes`` puts on the wire."""
    if not max_entry_bytes:
        return len(batch.lengths)
    return sum(max(1, -(-n // max_entry_bytes)) for n in batch.lengths)


def _raw_rate(receiver: Receiver, bufs: dict[str, torch.Tensor], tokens: int, repeats: int,
              pattern_seconds: float, per_buffer: int | None = None) -> float:
    """GB/s of the raw socket moving the first ``tokens`` slots of every buffer (the bytes
    and memory of the contiguous write; ``per_buffer``: only that many bytes of each, from
    its start), one sendall each, on a connection made once (as the engines' are),
    acknowledged with one byte per message."""
    views = [t[:tokens].numpy().view("uint8").reshape(-1)[:per_buffer] for t in bufs.values()]
    nbytes = sum(v.size for v in views)
    head = nbytes.to_bytes(8, "little")
    with receiver.raw() as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def raw() -> None:
            sock.sendall(head)
            for v in views:
                sock.sendall(v)
            if sock.recv(1) != b"k":
                raise RuntimeError("the raw socket's receiver went away")
        raw()  # warm-up, as for the engines
        best = best_time(raw, repeats, pattern_seconds)
    got = receiver.raw_done()
    if not got or got % nbytes:
        raise RuntimeError(f"the raw socket delivered {got} bytes, not a multiple of {nbytes}")
    return nbytes / best / 1e9


def prefix(batch: WriteBatch, max_entries: int) -> WriteBatch:
    """What is timed of ``batch``: its first ``max_entries`` entries (``batch`` itself when
    it has no more)."""
    if len(batch.src) <= max_entries:
        return batch
    return WriteBatch(batch.src[:max_entries], batch.dst[:max_entries], batch.lengths[:max_entries])


def measure_case(engine_name: str, receiver: Receiver, key: str, tokens: int, pats: list[Pattern],
                 page_sizes: Sequence[int], churn: Churn, repeats: int, max_entries: int,
                 pattern_seconds: float) -> CaseResult:
    """Every pattern of one (engine, shape, request size), and the raw socket's bytes.

    The raw socket goes first, before either side has an engine: an engine's threads
    (NIXL's UCX progress thread polls) would take CPU from it on a small machine; the
    engines' own writes run with them, as they do in a server."""
    from pdserve.disagg.engines import make_transfer_engine

    shape = SHAPES[key]
    slots = max(pool_slots(tokens, page_sizes, churn), tokens)
    bufs = shape.buffers(slots)
    raw = _raw_rate(receiver, bufs, tokens, repeats, pattern_seconds)
    # A landing area where a pattern lands (sized for this request, as decode's holds several).
    session, metadata, dst_layout, landing = receiver.setup(key, slots, tokens if any(p.landed for p in pats) else 0)
    engine = make_transfer_engine(engine_name, host=HOST)
    try:
        for t in bufs.values():
            engine.register(t.data_ptr(), t.numel() * t.element_size())
        engine.add_peer(session, metadata)
        plan = plan_transfer(layout_of(bufs), dst_layout, list(bufs))
        split_at = getattr(engine, "max_entry_bytes", "absent")

        def run(pat: Pattern, unsplit: bool = False) -> Rate:
            if pat.landed:  # as prefill writes a landing piece decode gave it (prefill_manager.room_plans)
                assert landing is not None
                base = landing.ptr + receiver.land(pat.dst)
                regions, _ = landing_regions(dst_layout, shape.names, len(pat.dst))
                batch = plan.landed(base, regions, len(pat.dst)).writes(pat.src, range(len(pat.dst)))
            else:
                batch = plan.writes(pat.src, pat.dst)
            timed = prefix(batch, max_entries)

            def write() -> None:
                engine.write(session, timed)
                if pat.landed:  # what decode does before the request can run: into its slots
                    receiver.unpack()
            if split_at != "absent":
                engine.max_entry_bytes = None if unsplit else split_at  # type: ignore[attr-defined]
            try:
                t = best_time(write, repeats, pattern_seconds)
            finally:
                if split_at != "absent":
                    engine.max_entry_bytes = split_at  # type: ignore[attr-defined]
            if timed is batch:  # the whole batch went: every slot holds the sender's values
                receiver.check(pat.dst)
            contiguous = pat.key == "contiguous"
            return Rate(timed.nbytes / t / 1e9, len(batch.src), len(timed.src),
                        None if contiguous or pat.key == "shuffle" else pat.tokens_per_run,
                        wire_entries(batch, split_at) if contiguous and not unsplit and isinstance(split_at, int)
                        else None)

        first = pats[0]
        if first.key != "contiguous":
            raise ValueError("the first pattern must be the contiguous one (it warms the connection up)")
        engine.write(session, plan.writes(first.src, first.dst))  # warm-up: the first write connects
        rates: dict[str, Rate | None] = {}
        for pat in pats:
            receiver.clear(pat.dst)
            rates[pat.key] = run(pat)
            if pat.key == "contiguous":
                # n/a where the engine does not split entries (no attribute, or None already)
                receiver.clear(pat.dst)
                rates["unsplit"] = run(pat, unsplit=True) if split_at not in ("absent", None) else None
    finally:
        engine.close()
        receiver.close_case()
    return CaseResult(engine_name, key, tokens, tokens * shape.token_bytes, raw, rates)


@dataclass
class TpResult:
    """One --decode-tp case: the bytes decode rank 0 receives (its heads of the request),
    the raw socket moving as many, and the two ways of writing them."""
    engine: str
    shape: str
    tokens: int
    decode_tp: int
    nbytes: int
    raw: float
    direct: Rate    # plan.writes into the rank's slots: one entry per position and buffer
    gathered: Rate  # gather buffer -> landing piece -> unpack: one entry per buffer and piece
    split_s: float  # SourceGather.split's time (the plan's per-position entries, built and dropped)


def measure_tp_case(engine_name: str, receiver: Receiver, key: str, tokens: int, decode_tp: int, repeats: int,
                    max_entries: int, pattern_seconds: float, gather_bytes: int = GATHER_BYTES) -> TpResult:
    """One request of ``tokens`` tokens sent by a TP1 prefill rank to decode rank 0 at TP
    ``decode_tp``, which holds ``kv_heads / decode_tp`` heads of each slot: contiguous
    slots on both sides, so every entry the plan cannot coalesce is the heads' stride.

    - "tp direct": ``plan.writes`` into the rank's slots (one entry per position and buffer;
      a batch of more than ``max_entries`` is timed on its prefix, then written whole,
      untimed, for the byte check);
    - "tp gathered": as pdserve sends it (``PrefillTransferManager._send``): the rank's
      landing piece (``landing_regions`` cut by the sending prefill rank), the sender's
      ``SourceGather`` (``gather_bytes``) copying the rows into its registered buffer and
      writing one entry per buffer and piece, the receiver's unpack; all three timed (the
      split, which builds the plan's entries to choose the pairs, is timed apart: as
      ``plan.writes`` is not timed for "tp direct").

    Both are checked on the receiver (``head_codes``: the rank's heads of the sender's
    slots, position by position). The raw socket moves as many bytes first, before either
    side has an engine (see ``measure_case``)."""
    from pdserve.disagg.engines import make_transfer_engine

    shape = SHAPES[key]
    full, heads = shape.all_heads, shape.decode_heads(decode_tp)
    bufs = coded_buffers(shape, tokens)
    per_buffer = tokens * heads.count * shape.head_dim * 4
    raw = _raw_rate(receiver, bufs, tokens, repeats, pattern_seconds, per_buffer)
    session, metadata, dst_layout, landing = receiver.setup(key, tokens, tokens, decode_tp)
    assert landing is not None
    engine = make_transfer_engine(engine_name, host=HOST)
    try:
        sources = SourceRows()
        for t in bufs.values():
            engine.register(t.data_ptr(), t.numel() * t.element_size())
            sources.add(t)
        engine.add_peer(session, metadata)
        # As PrefillSide builds it: every prefill rank's heads (one rank, all of them).
        plan = plan_transfer(layout_of(bufs, full), dst_layout, shape.names, prefill_rank=0,
                             prefill_head_ranges=[full])
        gather = SourceGather(engine, sources, gather_bytes)
        regions, _ = landing_regions(dst_layout, shape.names, tokens, {n: [full] for n in shape.names})
        slots = range(tokens)

        def gathered_writes() -> tuple[Callable[[], None], list[int], float]:
            """A fresh (blanked) landing piece and the gathered send into it (entries
            counted per run), and the split's time."""
            base = landing.ptr + receiver.land(slots)
            t0 = time.perf_counter()
            planned, pairs = gather.split(plan.landed(base, regions, tokens), slots, slots)
            split_s = time.perf_counter() - t0
            entries: list[int] = []

            def send() -> None:
                n = 0
                if planned.src:  # (none here: every pair's entries are a strided row)
                    engine.write(session, planned)
                    n += len(planned.src)
                for piece in gather.batches(pairs, slots, slots):
                    engine.write(session, piece)
                    n += len(piece.src)
                receiver.unpack()
                entries.append(n)
            return send, entries, split_s

        receiver.clear(slots)
        warm, _, _ = gathered_writes()
        warm()  # the first write connects; the gather buffer is registered at its first use
        receiver.clear(slots)
        send, entries, split_s = gathered_writes()
        t = best_time(send, repeats, pattern_seconds)
        receiver.check_heads(slots, slots)
        nbytes = per_buffer * len(bufs)
        gathered = Rate(nbytes / t / 1e9, entries[-1], entries[-1])

        receiver.clear(slots)
        batch = plan.writes(slots, slots)
        timed = prefix(batch, max_entries)
        t = best_time(lambda: engine.write(session, timed), repeats, pattern_seconds)
        if timed is not batch:
            engine.write(session, batch)
        receiver.check_heads(slots, slots)
        direct = Rate(timed.nbytes / t / 1e9, len(batch.src), len(timed.src))
    finally:
        engine.close()
        receiver.close_case()
    return TpResult(engine_name, key, tokens, decode_tp, nbytes, raw, direct, gathered, split_s)


# ---- the table ----------------------------------------------------------------------------

ENGINE_TITLES = {"mooncake": "Mooncake", "nixl": "NIXL"}


SCATTERS = ("stack", "extent", "pd", "landed")  # a page size's columns, in order


def scatter_keys(page_sizes: Sequence[int]) -> list[str]:
    return [f"{kind} p{ps}" for ps in page_sizes for kind in SCATTERS]


def scatter_title(key: str) -> str:
    """A scatter's column: a landed one's time includes the receiver's unpack, and its
    entries are the source's runs."""
    if key.startswith("landed "):
        return f"{key} GB/s, write + unpack (/ contiguous; entries; source tokens/run)"
    return f"{key} GB/s (/ contiguous; entries; tokens/run)"


def table_header(page_sizes: Sequence[int]) -> list[str]:
    cols = ["engine", "model", "tokens", "MiB", "raw TCP GB/s", "contiguous GB/s (entries)", "contiguous / raw",
            "unsplit GB/s (entries)", "full shuffle p1 GB/s (/ contiguous; entries)"]
    cols += [scatter_title(k) for k in scatter_keys(page_sizes)]
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def _entries(r: Rate) -> str:
    star = "*" if r.timed_entries < r.entries else ""
    return f"{r.entries}{star}"


def format_row(res: CaseResult, page_sizes: Sequence[int]) -> str:
    """One table row; a pattern not measurable here (no such policy or attribute) is n/a."""
    rates = res.rates
    cont = rates["contiguous"]
    assert cont is not None

    def vs(r: Rate) -> str:
        return f"{r.gbps / cont.gbps:.2f}x" if cont.gbps > 0 else "-"

    wire = f" -> {cont.wire_entries} on the wire" if cont.wire_entries is not None else ""
    cells = [ENGINE_TITLES.get(res.engine, res.engine), SHAPES[res.shape].name, str(res.tokens),
             f"{res.nbytes / 2**20:.0f}" if res.nbytes >= 2**20 else f"{res.nbytes / 2**20:.2f}",
             f"{res.raw:.2f}", f"{cont.gbps:.2f} ({_entries(cont)}{wire})",
             f"{cont.gbps / res.raw:.2f}x" if res.raw > 0 else "-"]
    un = rates.get("unsplit")
    cells.append(f"{un.gbps:.2f} ({_entries(un)})" if un is not None else "n/a")
    sh = rates["shuffle"]
    assert sh is not None
    cells.append(f"{sh.gbps:.3f} ({vs(sh)}; {_entries(sh)})")
    for key in scatter_keys(page_sizes):
        r = rates.get(key)
        cells.append("n/a" if r is None else f"{r.gbps:.3f} ({vs(r)}; {_entries(r)}; {r.tokens_per_run:.1f})")
    return "| " + " | ".join(cells) + " |"


TP_COLUMNS = ("engine", "model", "tokens", "MiB moved", "raw TCP GB/s", "tp direct GB/s (/ raw; entries)",
              "tp gathered GB/s, gather + write + unpack (/ raw; entries)", "gathered / direct")


def tp_table_header() -> list[str]:
    return ["| " + " | ".join(TP_COLUMNS) + " |", "|" + "---|" * len(TP_COLUMNS)]


def format_tp_row(res: TpResult) -> str:
    """One row of the --decode-tp table."""
    def rate(r: Rate) -> str:
        vs = f"{r.gbps / res.raw:.2g}x" if res.raw > 0 else "-"
        return f"{r.gbps:.3f} ({vs}; {_entries(r)})"
    mib = res.nbytes / 2**20
    cells = [ENGINE_TITLES.get(res.engine, res.engine), SHAPES[res.shape].name, str(res.tokens),
             f"{mib:.0f}" if mib >= 1 else f"{mib:.2f}", f"{res.raw:.2f}", rate(res.direct), rate(res.gathered),
             f"{res.gathered.gbps / res.direct.gbps:.1f}x" if res.direct.gbps > 0 else "-"]
    return "| " + " | ".join(cells) + " |"


def sizes_of(shape: Shape, sizes_mib: Sequence[float], tokens: Sequence[int], max_bytes: float) -> list[int]:
    """The prompt lengths a shape is measured at (from --sizes-mib and --tokens), sorted,
    those over ``max_bytes`` of KV left out."""
    wanted = {shape.tokens_for(m) for m in sizes_mib} | set(tokens)
    return sorted(t for t in wanted if t * shape.token_bytes <= max_bytes)


# ---- part 2: the TTFT split ---------------------------------------------------------------

TTFT_PHASE_TIMEOUT_S = 300.0


def _until(done: Callable[[], bool], step: Callable[[], None], what: str,
           timeout_s: float = TTFT_PHASE_TIMEOUT_S) -> None:
    """Run ``step`` until ``done()``; RuntimeError naming ``what`` after ``timeout_s`` (a
    lost transfer must not spin the benchmark forever)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"TTFT split: {what} did not come within {timeout_s:g} s")
        step()


def ttft_split(model_dir: str, tokens: int, repeats: int, chunk: int, page_size: int,
               engine_name: str = "mooncake") -> dict[str, float]:
    """Median phase times (seconds) of ``repeats`` single-request handoffs."""
    import statistics

    from pdserve.config import ServerArgs
    from pdserve.disagg.decode_side import decode_scheduler
    from pdserve.disagg.engines import make_transfer_engine
    from pdserve.disagg.handoff import Phase
    from pdserve.disagg.prefill_side import prefill_scheduler
    from pdserve.disagg.rooms import RoomState
    from pdserve.model.parallel import TPGroup
    from pdserve.model.runner import ModelRunner
    from pdserve.requests import RequestBuilder
    from pdserve.sampling_params import SamplingParams
    from pdserve.scheduler.req import samples_from_message
    from pdserve.scheduler.scheduler import Scheduler

    args = ServerArgs(model_path=model_dir, chunked_prefill_size=chunk, page_size=page_size,
                      max_total_tokens=4 * tokens + 4096, disable_radix_cache=True)

    def runner() -> ModelRunner:
        return ModelRunner(args, Path(model_dir), TPGroup())
    text = str
    colo = Scheduler(args, runner(), text)  # type: ignore[arg-type]
    p = prefill_scheduler(args, runner(), text, make_transfer_engine(engine_name, host=HOST))  # type: ignore[arg-type]
    d = decode_scheduler(args, runner(), text, make_transfer_engine(engine_name, host=HOST),  # type: ignore[arg-type]
                         fetch_ranks=lambda url: [p.mode.manager.rank_info(1, HOST)])
    builder = RequestBuilder(None, 10**6, 10**6, 1, 0)
    params = SamplingParams.from_dict({"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    rng = random.Random(tokens)
    vocab = colo.vocab_size
    phases: dict[str, list[float]] = {k: [] for k in ("colocated", "prefill", "transfer", "commit", "total")}

    def both() -> None:
        p.step()
        d.step()  # decode connects, reserves and asks for the KV

    def arrived(room: int) -> bool:
        state, _, reason = d.mode.manager.poll(room)
        if state is RoomState.FAILED and not d.mode.handoffs.count(Phase.RECEIVING) and not d.mode.handoffs.count(
                Phase.QUEUED) and reason == f"unknown room {room}":
            return True  # decode's step in `both` already committed it (and forgot the room)
        if state is RoomState.FAILED:
            raise RuntimeError(f"TTFT split: the transfer of room {room} failed: {reason}")
        return state is RoomState.SUCCESS
    try:
        for i in range(repeats + 1):  # the first round connects the pair and warms up
            prompt = [rng.randrange(3, vocab) for _ in range(tokens)]
            c = samples_from_message(builder.group(prompt, params, False, 0))[0]
            t0 = time.perf_counter()
            colo.add(c)
            _until(lambda: bool(c.output_ids), colo.step, "the colocated first token")
            colocated = time.perf_counter() - t0
            _until(lambda: not colo.has_work, colo.step, "the colocated request's end")
            rp, rd = (samples_from_message(builder.group(prompt, params, False, 0))[0] for _ in range(2))
            for r in (rp, rd):
                r.bootstrap_host, r.bootstrap_port, r.bootstrap_room = HOST, 1, 1000 + i
            t0 = time.perf_counter()
            p.add(rp)
            d.add(rd)
            _until(lambda: bool(p.mode.handoffs.count(Phase.INFLIGHT)), both, "prefill's handoff")
            t_handoff = time.perf_counter()
            _until(lambda: arrived(1000 + i), lambda: time.sleep(0.0002), "the KV's arrival on decode")
            t_arrived = time.perf_counter()
            _until(lambda: bool(rd.output_ids), d.step, "decode's first token")
            t_first = time.perf_counter()
            _until(lambda: not (p.has_work or d.has_work), both, "the PD request's end")
            if i == 0:
                continue
            phases["colocated"].append(colocated)
            phases["prefill"].append(t_handoff - t0)
            phases["transfer"].append(t_arrived - t_handoff)
            phases["commit"].append(t_first - t_arrived)
            phases["total"].append(t_first - t0)
    finally:
        p.close()
        d.close()
    out = {k: statistics.median(v) for k, v in phases.items()}
    out["bytes"] = p.mode.manager.bytes_sent / (repeats + 1)
    return out


# ---- the command --------------------------------------------------------------------------

def _positive(flag: str, kind: type = int) -> Callable[[str], Any]:
    """An argparse type: ``kind`` (int or float) above 0, errors naming ``flag``."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            noun = "whole numbers" if kind is int else "numbers"
            raise argparse.ArgumentTypeError(f"{flag} takes {noun}, not {text!r}") from None
        if not value > 0:
            bound = ">= 1" if kind is int else "> 0"
            raise argparse.ArgumentTypeError(f"{flag} takes numbers {bound}, not {value}")
        return value
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--sizes-mib", type=_positive("--sizes-mib", float), nargs="*", default=None,
                    help="request sizes (MiB of KV; the prompt length follows per shape); default 1 16 64 256 "
                         "unless --tokens is given; none (the flag alone): only the TTFT split")
    ap.add_argument("--tokens", type=_positive("--tokens"), nargs="*", default=[],
                    help="prompt lengths measured too")
    ap.add_argument("--shapes", nargs="+", default=["demo", "wide"], choices=sorted(SHAPES))
    ap.add_argument("--page-sizes", type=_positive("--page-sizes"), nargs="+", default=[1, 16, 64],
                    help="page sizes of the realistic scatter (64: the PD default, config.PD_PAGE_SIZE)")
    ap.add_argument("--repeats", type=_positive("--repeats"), default=3)
    ap.add_argument("--max-bytes", type=_positive("--max-bytes", float), default=2.5e9,
                    help="skip requests with more KV bytes than this (the two pools hold about "
                         "2 x --pool-factor + 1 times the largest request)")
    ap.add_argument("--max-entries", type=_positive("--max-entries"), default=32768,
                    help="time at most this many entries of a batch (its first ones; marked *)")
    ap.add_argument("--pattern-seconds", type=_positive("--pattern-seconds", float), default=2.0,
                    help="no further repeat of a pattern once its writes took this long")
    ap.add_argument("--pool-factor", type=_positive("--pool-factor", float), default=Churn.pool_factor,
                    help="the churned pools' size, in requests (at least 1.5)")
    ap.add_argument("--churn-steps", type=_positive("--churn-steps"), default=Churn.steps)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-tokens", type=_positive("--ttft-tokens"), nargs="*", default=[512, 2000],
                    help="prompt lengths of the TTFT split (none: skip it)")
    ap.add_argument("--ttft-engine", default="mooncake", choices=ENGINES, help="the TTFT split's engine")
    ap.add_argument("--ttft-model", default=None, help="model of the TTFT split (default: the demo model)")
    ap.add_argument("--chunk", type=_positive("--chunk"), default=512,
                    help="prefill chunk size of the TTFT split and of the churn")
    ap.add_argument("--page-size", type=_positive("--page-size"), default=PD_PAGE_SIZE,
                    help="page size of the TTFT split (default: a PD server's)")
    ap.add_argument("--decode-tp", type=_positive("--decode-tp"), default=1,
                    help="above 1: measure instead what a TP1 prefill rank sends decode rank 0 at this TP (its "
                         "share of each slot's KV heads), written directly vs through the gather buffer into a "
                         "landing piece (a separate table)")
    ap.add_argument("--nixl-progress-delay-us", type=int, default=None,
                    help="NIXL engines' pause between progress polls, in microseconds (default: pdserve's, "
                         "NixlTransfer.PROGRESS_DELAY_US; 0 is NIXL's own busy loop)")
    args = ap.parse_args(argv)
    if args.nixl_progress_delay_us is not None and args.nixl_progress_delay_us < 0:
        ap.error(f"--nixl-progress-delay-us must be >= 0, not {args.nixl_progress_delay_us}")
    if args.pool_factor < 1.5:
        ap.error(f"--pool-factor must be at least 1.5 (the pool holds the measured request and others), "
                 f"not {args.pool_factor}")
    if args.decode_tp > 1:
        for key in args.shapes:
            heads = SHAPES[key].kv_heads
            if heads % args.decode_tp and args.decode_tp % heads:
                ap.error(f"--decode-tp {args.decode_tp} does not shard the {heads} KV heads of shape {key!r} "
                         "(one must divide the other)")
            if heads == 1:
                ap.error(f"--decode-tp: shape {key!r} has one KV head, every decode rank holds all of it")
    if args.sizes_mib is None:
        args.sizes_mib = [] if args.tokens else [1, 16, 64, 256]
    if not args.sizes_mib and not args.tokens and not args.ttft_tokens:
        ap.error("nothing to measure: give --sizes-mib, --tokens or --ttft-tokens")
    return args


def measure_tp(args: argparse.Namespace, sizes: dict[str, list[int]]) -> None:
    """The --decode-tp table: each engine, shape and size through ``measure_tp_case``."""
    print(f"KV writes from a TP1 prefill rank to decode rank 0 at TP {args.decode_tp} (its share of each slot's KV "
          f"heads), two processes on {HOST}; contiguous slots on both sides; best of at least {args.repeats} (at "
          f"most {args.pattern_seconds:g} s of repeats per pattern). MiB moved: the bytes the rank receives (the "
          f"request's KV / {args.decode_tp}), raw TCP moving as many. tp direct: plan.writes into the rank's slots "
          "(one entry per position and buffer); tp gathered: the gather buffer (SourceGather, "
          f"{GATHER_BYTES >> 20} MiB) written into a landing piece, one entry per buffer and piece, timed with "
          f"the copy into the buffer and the receiver's unpack. entries: * = the first {args.max_entries} timed "
          "(the whole batch written after, untimed, for the byte check).\n", flush=True)
    for line in tp_table_header():
        print(line)
    splits = []
    for name in args.engines:
        receiver = Receiver(name, args.nixl_progress_delay_us)
        try:
            for key in args.shapes:
                for tokens in sizes[key]:
                    res = measure_tp_case(name, receiver, key, tokens, args.decode_tp, args.repeats,
                                          args.max_entries, args.pattern_seconds)
                    print(format_tp_row(res), flush=True)
                    splits.append(f"{ENGINE_TITLES.get(name, name)} {key} {tokens}: {res.split_s * 1e3:.1f}")
        finally:
            receiver.stop()
    # The server's transfer thread also runs the split (choosing the pairs to gather builds
    # the plan's per-position entries); it is not in the figures above, as plan.writes is not.
    print("\nSourceGather.split, once per request before the gathered writes (not timed above), ms: "
          + "; ".join(splits), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_nixl_progress_delay(args.nixl_progress_delay_us)
    churn = Churn(pool_factor=args.pool_factor, steps=args.churn_steps, chunk=args.chunk)
    sizes = {key: sizes_of(SHAPES[key], args.sizes_mib, args.tokens, args.max_bytes) for key in args.shapes}
    if any(sizes.values()) and args.decode_tp > 1:
        measure_tp(args, sizes)
    elif any(sizes.values()):
        extent = has_extent_policy()
        print(f"KV writes through the transfer plan, two processes on {HOST}; best of at least {args.repeats} "
              f"(at most {args.pattern_seconds:g} s of repeats per pattern). Scatter: the pool after churn "
              f"({churn.pool_factor:g}x the request, filled to {churn.fill:.0%}, {churn.steps} decode steps, "
              f"prompts in chunks of {churn.chunk}); stack: PageAllocator.alloc_ids(n) everywhere; extent: "
              + ("alloc_ids(n, contiguous=True) for prompt chunks and reserves"
                 if extent else "n/a (this PageAllocator has no contiguous= policy)")
              + ("; pd: the source churned as a prefill server's pool (no decode steps), the destination "
                 "as extent's (a decode server's reserve); landed: pd's slots written into the receiver's "
                 "landing area, timed with the receiver's unpack into the slots (a pipe command)"
                 if extent else "")
              + f". entries: the plan's write entries (* = the first {args.max_entries} timed); "
              "tokens/run: tokens per run of consecutive slots on both sides (landed: on the source side). "
              "unsplit: contiguous with the "
              "engine's max_entry_bytes = None (n/a: the engine does not split entries).\n", flush=True)
        for line in table_header(args.page_sizes):
            print(line)
        cache: dict[int, list[Pattern]] = {}  # the same slots for every engine and shape
        for name in args.engines:
            receiver = Receiver(name, args.nixl_progress_delay_us)
            try:
                for key in args.shapes:
                    for tokens in sizes[key]:
                        if tokens not in cache:
                            cache[tokens] = patterns(tokens, args.page_sizes, args.seed + 2 * tokens, churn)
                        res = measure_case(name, receiver, key, tokens, cache[tokens], args.page_sizes,
                                           churn, args.repeats, args.max_entries, args.pattern_seconds)
                        print(format_row(res, args.page_sizes), flush=True)
            finally:
                receiver.stop()
    if not args.ttft_tokens:
        return
    from pdserve import assets

    model = args.ttft_model or str(assets.path("demo"))
    print(f"\nTTFT split, {ENGINE_TITLES[args.ttft_engine]}, {model}, chunk {args.chunk}, page size "
          f"{args.page_size}, median of {args.repeats} (ms)\n")
    print("| prompt tokens | KV MiB | colocated TTFT | PD TTFT | prefill (setup + compute) | transfer tail "
          "| decode commit | PD / colocated |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in args.ttft_tokens:
        r = ttft_split(model, tokens, args.repeats, args.chunk, args.page_size, args.ttft_engine)
        ms = {k: v * 1e3 for k, v in r.items() if k != "bytes"}
        print(f"| {tokens} | {r['bytes'] / 2**20:.1f} | {ms['colocated']:.1f} | {ms['total']:.1f} | "
              f"{ms['prefill']:.1f} | {ms['transfer']:.1f} | {ms['commit']:.1f} | "
              f"{r['total'] / r['colocated']:.2f}x |", flush=True)


def _run_and_exit() -> None:
    """main(), then os._exit: a process that created a UCX backend (NIXL) must not run the
    interpreter's exit (its libraries' teardown can crash it)."""
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _run_and_exit()
