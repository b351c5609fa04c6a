"""The prefill end of a room's handoff: ``PrefillTransferManager``.

Split from ``manager.py`` (see there): the link (``link.py``) is shared, the two ends
are not; each end's rooms, peers and threads are its own, and neither calls into the
other except through messages. This end answers decode's handshakes (planning which of
its buffers go where), collects one ``TransferRequest`` per decode rank of a room, and
owns a transfer thread that performs the room's KV writes in order and then sends its
handoff record. Schedulers call the non-blocking methods (``open`` / ``ready`` /
``send`` / ``finish`` / ``abort`` / ``expire``); nothing they call waits on the network.

Failures are per room and carry a reason: a write error fails that room only; a decode
peer that misses heartbeats fails every room it was part of. A failed room's
``WritesDone`` is sent only once this rank's transfer thread has no write for it queued
or running: decode reuses the room's pages only after that word (an ``Abort`` only says
the room failed).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from pdserve.disagg import protocol as P
from pdserve.disagg.gather import SourceGather
from pdserve.disagg.layout import (BufferPair, BufferSpec, CompatRecord, HandshakeError, HeadRange, KVLayout,
                                   TransferPlan, check_compatible, plan_transfer)
from pdserve.disagg.landing import landing_names, landing_regions
from pdserve.disagg.link import LinkConfig, _Link, _Side
from pdserve.disagg.rooms import RoomError, RoomState, RoomTable
from pdserve.disagg.transfer import TransferEngine, TransferError, WriteBatch

# The managers' messages keep the logger name they had before the split (log filters).
logger = logging.getLogger("pdserve.disagg.manager")


@dataclass
class _DecodePeer:
    handshake: P.Handshake
    plan: TransferPlan                       # the target KV heads this rank owes that decode rank
    feature_plan: TransferPlan | None        # rank 0: per-position target features (decode drafts itself)
    draft_plan: TransferPlan | None = None   # the draft KV heads owed (both sides run the same draft)


@dataclass
class _PrefillRoom:
    # One transfer request per decode rank (a TP-n decode server sends n); the room
    # is ready once all of them arrived.
    requests: dict[str, P.TransferRequest]
    expected: int
    pending: int = 0                       # queued writes not yet done
    record: P.HandoffRecord | None = None  # set by finish(); sent once pending == 0
    acked: bool = False                    # decode told that no write is left in flight
    released: bool = False                 # the scheduler is done; drop once pending == 0
    # Per decode rank: its plans for this room (into its slots or its landing piece), made
    # at the room's first write (transfer thread only).
    plans: dict[str, "_RoomPlans"] = field(default_factory=dict)


@dataclass(frozen=True)
class _RoomPlans:
    """What one decode rank's request of a room is written with."""
    target: TransferPlan
    features: TransferPlan | None
    draft: TransferPlan | None
    landed: bool  # into the rank's landing piece: destination i is position i of the request


def room_plans(peer: _DecodePeer, request: P.TransferRequest,
               senders: Mapping[str, Sequence[HeadRange]] | None = None) -> _RoomPlans:
    """The plans of one decode rank's request: its peer's, or, when the request asked for
    a landing piece, the same writes aimed at that piece (TransferError if the piece is
    not within the landing area decode published). ``senders``: every prefill rank's heads
    of each head-sharded buffer (the piece's regions follow them)."""
    if request.landing_offset < 0:
        return _RoomPlans(peer.plan, peer.feature_plan, peer.draft_plan, False)
    hs = peer.handshake
    if hs.landing is None:
        raise TransferError("decode asked for a landing piece but published no landing area")
    positions = len(request.dst_slots)
    names = landing_names(hs.wanted, request.want_features, request.want_draft_state)
    regions, size = landing_regions(hs.layout, names, positions, senders)
    area_bytes = hs.landing.num_slots * hs.landing.slot_bytes
    if request.landing_offset + size > area_bytes:
        raise TransferError(f"a landing piece of {size} bytes at {request.landing_offset} is outside decode's "
                            f"{area_bytes}-byte landing area")
    base = hs.landing.ptr + request.landing_offset

    def land(plan: TransferPlan | None, wanted: bool) -> TransferPlan | None:
        return plan.landed(base, regions, positions) if plan is not None and wanted else None
    return _RoomPlans(land(peer.plan, True), land(peer.feature_plan, request.want_features),  # type: ignore[arg-type]
                      land(peer.draft_plan, request.want_draft_state), True)


def sender_ranges(layout: KVLayout, target: Sequence[HeadRange] | None,
                  draft: Sequence[HeadRange] | None) -> dict[str, list[HeadRange]]:
    """Each head-sharded buffer of ``layout`` with every prefill rank's heads of it (the
    target's or the draft's ranges); a buffer whose ranges are not known is left out."""
    out = {}
    for b in layout.buffers:
        ranges = draft if b.name.startswith("draft.") else target
        if b.heads is not None and ranges:
            out[b.name] = list(ranges)
    return out


class PrefillTransferManager(_Side):
    def __init__(self, engine: TransferEngine, compat: CompatRecord, layout: KVLayout, tp_rank: int,
                 head_ranges: Sequence[HeadRange] | None, host: str = "127.0.0.1",
                 cfg: LinkConfig = LinkConfig(),
                 provide_features: Callable[[tuple[int, ...], int], BufferSpec] | None = None,
                 draft_head_ranges: Sequence[HeadRange] | None = None, gather: SourceGather | None = None) -> None:
        """``provide_features(layers, width)``: called at a handshake that needs target
        features this side does not publish; returns the (registered) buffer it will
        fill, or raises HandshakeError. ``head_ranges`` / ``draft_head_ranges``: the
        target's / the draft's KV heads each prefill rank holds. ``gather``: the rank's
        gather buffer for writes into landing pieces (None: every write as planned)."""
        self.engine, self.compat, self.layout = engine, compat, layout
        self.gather = gather
        self._provide_features = provide_features
        self.tp_rank, self.head_ranges = tp_rank, list(head_ranges) if head_ranges else None
        self.draft_head_ranges = list(draft_head_ranges) if draft_head_ranges else None
        # Every prefill rank's heads of each head-sharded buffer: how a decode rank's
        # landing piece is cut (landing.landing_regions; decode reads them from the ranks'
        # layouts).
        self.sender_ranges = sender_ranges(layout, self.head_ranges, self.draft_head_ranges)
        self.rooms = RoomTable(cfg.deadlines)
        self._peers: dict[str, _DecodePeer] = {}
        self._by_addr: dict[str, str] = {}
        self._rooms: dict[int, _PrefillRoom] = {}
        self._failed: dict[int, tuple[str, float]] = {}  # released failed room -> (reason, until), oldest first
        self._lock = threading.Lock()
        self._work: queue.Queue[tuple[str, int, Any] | None] = queue.Queue()
        # What crossed the split from this rank, by kind (TRANSFER_KINDS).
        self.bytes_by_kind = dict.fromkeys(P.TRANSFER_KINDS, 0)
        self.transfer_seconds = 0.0
        self.peers_lost = 0  # decode ranks that stopped answering heartbeats
        self._link = _Link(host, f"prefill{tp_rank}", cfg, self._receive, self._on_peer_dead, self._unsendable)
        self._worker = threading.Thread(target=self._transfer_loop, name=f"prefill{tp_rank}-xfer", daemon=True)
        self._worker.start()

    def rank_info(self, tp_size: int, host: str) -> P.RankInfo:
        port = int(self._link.addr.rsplit(":", 1)[1])
        return P.RankInfo(self.tp_rank, tp_size, host, port, self.engine.session_id, self.compat, self.layout)

    # ---- messages (I/O thread) ----------------------------------------------------
    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, P.Handshake):
            self._handshake(msg)
        elif isinstance(msg, P.TransferRequest):
            self._transfer_request(msg)
        elif isinstance(msg, P.Abort):
            self.rooms.fail(msg.room, f"aborted by decode: {msg.reason}", "aborted")
            self._ack_if_idle(msg.room)

    def _fail_touched(self, room: int, msg: Any, reason: str) -> None:
        if self.rooms.fail(room, reason, "internal_error"):
            self._tell(room, P.Abort(room, reason))
        if isinstance(msg, P.TransferRequest):  # its sender may not be among the room's peers yet
            with self._lock:
                peer = self._peers.get(msg.decode_id)
                known = msg.room in self._rooms and msg.decode_id in self._rooms[msg.room].requests
            if peer is not None and not known:
                self._link.send(peer.handshake.control_addr, P.Abort(room, reason))
                self._link.send(peer.handshake.control_addr, P.WritesDone(room, self._link.addr))
        self._ack_if_idle(room)

    def _ack_if_idle(self, room: int, pr: _PrefillRoom | None = None) -> None:
        """Tell decode a failed room's pages are safe to reuse once no write of ours
        is queued or running for it any more (WritesDone; an Abort is no such word)."""
        with self._lock:
            pr = pr if pr is not None else self._rooms.get(room)
            if pr is None or pr.pending or pr.acked:
                return
            if self.status(room)[0] is not RoomState.FAILED:
                return
            pr.acked = True
        self._tell(room, P.WritesDone(room, self._link.addr), pr)

    def _destinations(self, room: int, pr: _PrefillRoom | None = None
                      ) -> list[tuple[_DecodePeer, P.TransferRequest]]:
        """The decode ranks of a room that are still connected, with their requests."""
        with self._lock:
            pr = pr if pr is not None else self._rooms.get(room)
            if pr is None:
                return []
            return [(self._peers[d], req) for d, req in pr.requests.items() if d in self._peers]

    def _tell(self, room: int, msg: Any, pr: _PrefillRoom | None = None) -> None:
        for peer, _ in self._destinations(room, pr):
            self._link.send(peer.handshake.control_addr, msg)

    def release(self, room: int) -> None:
        """The scheduler is done with a room. A room whose writes are still queued or
        running stays known to the transfer thread until they return (it then says
        WritesDone for a failed room: decode waits for that before reusing pages)."""
        state, reason = self.status(room)
        with self._lock:
            pr = self._rooms.get(room)
            if pr is not None and pr.pending:
                pr.released = True
            else:
                self._rooms.pop(room, None)
            if state is RoomState.FAILED and self.rooms.get(room) is not None:
                self._remember_failure(room, reason or "failed")
        self.rooms.close_if_ended(room)

    def _remember_failure(self, room: int, reason: str) -> None:
        """Keep a released failed room's reason for as long as decode might still ask for
        it (its transfer request can arrive late): it is answered at once instead of
        opening a room nobody computes. Caller holds the lock."""
        now = time.monotonic()
        while self._failed and next(iter(self._failed.values()))[1] < now:
            self._failed.pop(next(iter(self._failed)))
        self._failed[room] = (reason, now + self.rooms.deadlines.waiting_for_input)

    def _handshake(self, hs: P.Handshake) -> None:
        try:
            check_compatible(self.compat, hs.compat)
            draft = [n for n in hs.wanted if n.startswith("draft.")]
            wanted = [n for n in hs.wanted if n != "features" and n not in draft]
            plan = plan_transfer(self.layout, hs.layout, wanted, self.tp_rank, self.head_ranges)
            feature_plan = draft_plan = None
            if "features" in hs.wanted and self.tp_rank == 0:
                # Features are the same on every rank (replicated hidden states): rank 0 sends them.
                feature_plan = self._feature_plan(hs)
            if draft and self.compat.shares_draft_with(hs.compat):
                # The draft KV is head-sharded like the target's: each rank sends what it owes.
                # Features or draft state: decode's choice per request (TransferRequest).
                draft_plan = plan_transfer(self.layout, hs.layout, draft, self.tp_rank, self.draft_head_ranges)
            # What the engine needs to write into decode's memory (NIXL: its agent metadata).
            self.engine.add_peer(hs.session_id, hs.engine_metadata)
        except (HandshakeError, TransferError) as exc:
            self._link.send(hs.control_addr, P.HandshakeReply(self._link.addr, False, str(exc)))
            return
        with self._lock:
            self._peers[hs.decode_id] = _DecodePeer(hs, plan, feature_plan, draft_plan)
            self._by_addr[hs.control_addr] = hs.decode_id
        self._link.watch(hs.control_addr)
        self._link.send(hs.control_addr, P.HandshakeReply(self._link.addr, True))

    def _feature_plan(self, hs: P.Handshake) -> TransferPlan:
        dst = hs.layout.by_name().get("features")
        if dst is None:
            raise HandshakeError("decode asks for features but publishes no features buffer")
        src = self.layout.by_name().get("features")
        if src is None:
            if self._provide_features is None:
                raise HandshakeError("decode needs target features but this prefill server captures none")
            src = self._provide_features(tuple(hs.feature_layers), dst.slot_bytes)
        return plan_transfer(KVLayout(self.layout.page_size, (src,)), hs.layout, ["features"])

    def _transfer_request(self, req: P.TransferRequest) -> None:
        with self._lock:
            peer = self._peers.get(req.decode_id)
        if peer is None:
            logger.warning("transfer request for room %d from unknown decode %s", req.room, req.decode_id)
            return
        with self._lock:
            failed = self._failed.get(req.room)
        if failed is not None and failed[1] >= time.monotonic():  # prefill already failed it
            self._link.send(peer.handshake.control_addr, P.Abort(req.room, failed[0]))
            self._link.send(peer.handshake.control_addr, P.WritesDone(req.room, self._link.addr))
            return
        try:
            # Fresh when decode asked before the prefill request arrived (which joins it).
            _, fresh = self.rooms.open_or_join(req.room)
        except RoomError as exc:
            self._link.send(peer.handshake.control_addr, P.Abort(req.room, str(exc)))
            return
        with self._lock:
            pr = self._rooms.get(req.room)
            if pr is None or fresh:
                pr = self._rooms[req.room] = _PrefillRoom({}, peer.handshake.tp_size)
            pr.requests[req.decode_id] = req
        self.rooms.advance(req.room, RoomState.WAITING_FOR_INPUT, only_from=RoomState.BOOTSTRAPPING)

    def _on_peer_dead(self, addr: str) -> None:
        with self._lock:
            decode_id = self._by_addr.pop(addr, None)
            if decode_id is None:
                return
            peer = self._peers.pop(decode_id, None)
            rooms = [r for r, pr in self._rooms.items() if decode_id in pr.requests]
            self.peers_lost += 1
        logger.warning("decode server %s stopped answering heartbeats: forgotten, %d room(s) with it failed",
                       addr, len(rooms))
        self.rooms.fail_all(f"decode server {addr} stopped answering heartbeats", "peer_dead", rooms)
        if peer is not None:
            self.engine.remove_peer(peer.handshake.session_id)

    # ---- scheduler-facing ----------------------------------------------------------
    def open(self, room: int) -> None:
        """The prefill request of ``room`` arrived (it may precede or follow decode's)."""
        self.rooms.open_or_join(room)  # decode's transfer request may have opened it first
        with self._lock:
            self._failed.pop(room, None)  # the number is in use again

    def ready(self, room: int) -> bool:
        """Decode said where the KV goes: the prefill may send."""
        with self._lock:
            pr = self._rooms.get(room)
            known = pr is not None and len(pr.requests) >= pr.expected
        r = self.rooms.get(room)
        return known and r is not None and r.state in (RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING)

    def send(self, room: int, src_slots: Sequence[int], first_position: int, ready: Any = None,
             draft: bool = False) -> None:
        """Queue the write of prompt positions [first_position, +len(src_slots)) of ``room``;
        ``ready`` (a CUDA event recorded after the forward that filled them) is waited
        for before the write reads them. ``draft``: their draft KV, for the decode ranks
        that asked for the draft state (the target KV otherwise)."""
        if self.rooms.get(room) is not None:  # rooms are only closed by this (the scheduler's) thread
            self.rooms.advance(room, RoomState.TRANSFERRING, only_from=RoomState.WAITING_FOR_INPUT)
        with self._lock:
            pr = self._rooms.get(room)
            if pr is None:
                raise RuntimeError(f"room {room}: send() before decode's transfer request")
            pr.pending += 1
        self._work.put(("write", room, (list(src_slots), first_position, ready, draft)))

    def wants_draft_state(self, room: int) -> bool:
        """Decode asked for the draft state of ``room`` (its draft is this server's)."""
        with self._lock:
            pr = self._rooms.get(room)
            return pr is not None and any(r.want_draft_state for r in pr.requests.values())

    def finish(self, room: int, record: P.HandoffRecord) -> None:
        """The last chunk is queued: send the handoff record once all writes are done."""
        self._work.put(("finish", room, record))

    def status(self, room: int) -> tuple[RoomState, str | None]:
        r = self.rooms.get(room)
        if r is None:
            return RoomState.FAILED, f"unknown room {room}"
        return r.state, r.reason

    def abort(self, room: int, reason: str) -> None:
        if self.rooms.fail(room, reason, "aborted"):
            self._tell(room, P.Abort(room, reason))
        self._ack_if_idle(room)

    def expire(self) -> list[int]:
        """Fail rooms past their deadline; tell their decode servers."""
        failed = self.rooms.expire()
        for r in failed:
            self._tell(r.room, P.Abort(r.room, r.reason or "timeout"))
            self._ack_if_idle(r.room)
        return [r.room for r in failed]

    # ---- transfer thread ------------------------------------------------------------
    def _transfer_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            kind, room, arg = item
            try:
                if kind == "write":
                    self._write(room, *arg)
                else:
                    self._finish(room, arg)
            except Exception as exc:  # fail the room, keep the thread
                logger.exception("room %d: sending the handoff record failed", room)
                if self.rooms.fail(room, f"KV transfer failed: {exc}", "transfer_error"):
                    self._tell(room, P.Abort(room, f"KV transfer failed: {exc}"))
                self._ack_if_idle(room)

    def _write(self, room: int, src_slots: list[int], first: int, ready: Any = None, draft: bool = False) -> None:
        with self._lock:
            pr = self._rooms.get(room)
        if pr is None:
            return
        try:
            state, _ = self.status(room)
            if state is RoomState.FAILED:
                return
            if ready is not None:
                ready.synchronize()  # the forward that wrote these slots has finished
            for peer, request in self._destinations(room):
                # Positions before first_position are in decode's cache already.
                skip = max(0, request.first_position - first)
                src = src_slots[skip:]
                if not src:
                    continue
                start = first + skip - request.first_position
                if start + len(src) > len(request.dst_slots):
                    raise TransferError(f"positions {first}..{first + len(src_slots)} exceed the "
                                        f"{request.first_position} + {len(request.dst_slots)} positions decode "
                                        "holds and reserved")
                plans = pr.plans.get(request.decode_id)
                if plans is None:
                    plans = pr.plans[request.decode_id] = room_plans(peer, request, self.sender_ranges)
                dst: Sequence[int] = (range(start, start + len(src)) if plans.landed
                                      else request.dst_slots[start: start + len(src)])
                t0 = time.perf_counter()
                if draft:
                    if not request.want_draft_state or plans.draft is None:
                        continue  # that decode rank drafts from features, or another rank sends
                    (draft_bytes,) = self._send(peer.handshake.session_id, [plans.draft], src, dst, plans.landed)
                    self.transfer_seconds += time.perf_counter() - t0
                    self.bytes_by_kind["draft_kv"] += draft_bytes
                    continue
                with_features = request.want_features and plans.features is not None
                sizes = self._send(peer.handshake.session_id,
                                   [plans.target, plans.features] if with_features else [plans.target],  # type: ignore
                                   src, dst, plans.landed)
                if not any(sizes):
                    continue  # this decode rank needs none of our heads
                self.transfer_seconds += time.perf_counter() - t0
                self.bytes_by_kind["target_kv"] += sizes[0]
                self.bytes_by_kind["features"] += sizes[1] if with_features else 0
        except Exception as exc:  # fail the room (before the acknowledgement below), keep the thread
            logger.exception("room %d: transfer failed", room)
            self.rooms.fail(room, f"KV transfer failed: {exc}", "transfer_error")
            self._tell(room, P.Abort(room, f"KV transfer failed: {exc}"), pr)
        finally:
            with self._lock:
                pr.pending -= 1
                drained = pr.released and not pr.pending
                if drained and self._rooms.get(room) is pr:
                    del self._rooms[room]
            self._maybe_send_record(room)
            if self.status(room)[0] is RoomState.FAILED or drained:
                self._ack_if_idle(room, pr)

    def _send(self, session: str, plans: list[TransferPlan], src: Sequence[int], dst: Sequence[int],
              landed: bool) -> list[int]:
        """Write what each plan moves of ``src`` to ``dst``: one engine write for what goes
        as planned, then, into a landing piece, the pairs worth gathering (``gather.py``)
        piece by piece. The bytes of each plan."""
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        gathered: list[BufferPair] = []
        sizes = []
        for plan in plans:
            if landed and self.gather is not None:
                batch, pairs = self.gather.split(plan, src, dst)
            else:
                batch, pairs = plan.writes(src, dst), []
            srcs += batch.src
            dsts += batch.dst
            lens += batch.lengths
            gathered += pairs
            sizes.append(batch.nbytes + len(src) * sum(p.length for p in pairs))
        if srcs:
            self.engine.write(session, WriteBatch(tuple(srcs), tuple(dsts), tuple(lens)))
        if gathered:
            assert self.gather is not None
            for piece in self.gather.batches(gathered, src, dst):
                self.engine.write(session, piece)
        return sizes

    def _finish(self, room: int, record: P.HandoffRecord) -> None:
        with self._lock:
            pr = self._rooms.get(room)
            if pr is None:
                return
            pr.record = record
        self._maybe_send_record(room)

    def _maybe_send_record(self, room: int) -> None:
        with self._lock:
            pr = self._rooms.get(room)
            if pr is None or pr.record is None or pr.pending:
                return
            record, pr.record = pr.record, None
        state, _ = self.status(room)
        dests = self._destinations(room)
        if state is not RoomState.TRANSFERRING or len(dests) < pr.expected:
            return  # a decode rank went away: the room fails through its heartbeat
        record = P.HandoffRecord(**{**record.__dict__, "sender": self._link.addr})
        self._tell(room, record)
        self.bytes_by_kind["metadata"] += len(P.encode(record)) * len(dests)
        self.rooms.advance(room, RoomState.SUCCESS)

    @property
    def bytes_sent(self) -> int:
        """Every byte sent, the metadata included."""
        return sum(self.bytes_by_kind.values())

    def close(self) -> None:
        self._work.put(None)
        self._worker.join(5)
        self._link.close()
