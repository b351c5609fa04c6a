"""Transfer managers: the prefill and decode ends of a room's handoff.

Each manager owns one control socket (a ZMQ PULL it binds) and one I/O thread
that owns every socket: it receives messages, sends queued ones, and sends and
checks heartbeats.  The prefill manager also owns a transfer thread that
performs the KV writes in order per room and then sends the room's handoff
record.  Schedulers call the non-blocking methods (``send`` / ``finish`` /
``add_room`` / ``poll``); nothing they call waits on the network.

Failures are per room and always carry a reason: a write error fails that room
only; a peer that misses heartbeats fails every room it was part of; an
exception in a handler is logged and fails the room its message named (both
sides hear of it), never the thread.

Page safety across a failure: decode keeps a failed room's pages out of use
until every prefill rank that could still write into them said ``WritesDone``
(sent only once that rank's transfer thread has no write for the room queued
or running) or died. An ``Abort`` only says the room failed.
"""

from __future__ import annotations

import abc
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import zmq

from pdserve.disagg import protocol as P
from pdserve.disagg.layout import (BufferSpec, CompatRecord, HandshakeError, HeadRange, KVLayout, TransferPlan,
                                   check_compatible, plan_transfer)
from pdserve.disagg.rooms import Deadlines, RoomError, RoomState, RoomTable
from pdserve.disagg.transfer import TransferEngine, TransferError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkConfig:
    heartbeat_interval_s: float = 1.0
    heartbeat_misses: int = 3           # a peer silent this many intervals is dead
    handshake_timeout_s: float = 10.0
    deadlines: Deadlines = Deadlines()
    # The deployment's shared secret: every control message is signed and checked (None:
    # unsigned, for servers that listen on loopback only).
    secret: bytes | None = None
    # The largest control frame sent or read (P.MAX_FRAME_BYTES: sized for a
    # TransferRequest of a 1M-token prompt); ZMQ drops a larger one unread.
    max_message_bytes: int = P.MAX_FRAME_BYTES


class _Link:
    """The I/O thread: one PULL socket in, PUSH sockets out, heartbeats."""

    def __init__(self, host: str, name: str, cfg: LinkConfig, on_message: Callable[[Any], None],
                 on_peer_dead: Callable[[str], None],
                 on_unsendable: Callable[[str, Any, str], None] | None = None) -> None:
        self.cfg = cfg
        self.name = name
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        # libzmq drops a larger frame (and its connection) before Python sees it.
        self._pull.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        port = self._pull.bind_to_random_port(f"tcp://{host}")  # the server's own host only
        self.addr = f"tcp://{host}:{port}"
        # Signed messages name their recipient: this address, which this side advertises
        # (RankInfo, Handshake.control_addr) and its peers send to.
        self.auth = P.Authenticator(cfg.secret, self.addr) if cfg.secret is not None else None
        self.refused = 0  # messages dropped: oversized, unsigned, forged, misaddressed, replayed or malformed
        self._out: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        # Outgoing messages wake the thread through a pipe (ZMQ sockets are not
        # thread-safe, an OS pipe is), so a send never waits out a poll timeout.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._push: dict[str, zmq.Socket] = {}
        self._peers: dict[str, float] = {}       # control addr -> last time heard from
        self._on_message = on_message
        self._on_peer_dead = on_peer_dead
        self._on_unsendable = on_unsendable
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-io", daemon=True)
        self._thread.start()

    def send(self, addr: str, msg: Any) -> None:
        self._put((addr, msg))

    def watch(self, addr: str) -> None:
        """Start heartbeating with a peer (and expecting its heartbeats)."""
        self._put((addr, "watch"))

    def forget(self, addr: str) -> None:
        self._put((addr, "forget"))

    def _put(self, item: tuple[str, Any] | None) -> None:
        self._out.put(item)
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    def close(self) -> None:
        self._stop.set()
        self._put(None)
        self._thread.join(5)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _socket(self, addr: str) -> zmq.Socket:
        sock = self._push.get(addr)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(addr)
            self._push[addr] = sock
        return sock

    def _send(self, addr: str, msg: Any) -> None:
        """Sign ``msg`` for ``addr`` (its recipient) and send it; a message too large for
        the frame limit is not sent: the room it names fails with the reason."""
        try:
            frame = P.encode(msg, self.auth, to=addr, max_bytes=self.cfg.max_message_bytes)
        except P.ProtocolError as exc:
            logger.error("%s: cannot send %s to %s: %s", self.name, type(msg).__name__, addr, exc)
            if self._on_unsendable is not None:
                self._on_unsendable(addr, msg, str(exc))
            return
        self._socket(addr).send(frame, zmq.NOBLOCK)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = 0.0
        seq = 0
        while not self._stop.is_set():
            try:
                wait_ms = max(1, min(100, int((next_beat - time.monotonic()) * 1000) + 1))
                for sock, _ in poller.poll(wait_ms):
                    if sock == self._wake_r:
                        try:
                            while os.read(self._wake_r, 4096):
                                pass
                        except BlockingIOError:
                            pass
                        continue
                    data = sock.recv()
                    try:
                        msg = P.decode(data, self.auth, max_bytes=self.cfg.max_message_bytes)
                    except P.ProtocolError as exc:
                        self.refused += 1
                        if self.refused <= 10 or self.refused % 1000 == 0:  # a flood must not flood the log
                            logger.warning("%s: dropped a message (%d so far): %s", self.name, self.refused, exc)
                        continue
                    if isinstance(msg, P.Heartbeat):
                        if msg.sender in self._peers:
                            self._peers[msg.sender] = time.monotonic()
                        continue
                    self._on_message(msg)
                while True:
                    try:
                        item = self._out.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        self._stop.set()
                        break
                    addr, msg = item
                    if msg == "watch":
                        self._peers.setdefault(addr, time.monotonic())
                    elif msg == "forget":
                        self._peers.pop(addr, None)
                    else:
                        self._send(addr, msg)
                now = time.monotonic()
                if now >= next_beat:
                    seq += 1
                    for addr in list(self._peers):
                        self._send(addr, P.Heartbeat(self.addr, seq))
                    next_beat = now + self.cfg.heartbeat_interval_s
                    limit = self.cfg.heartbeat_interval_s * self.cfg.heartbeat_misses
                    for addr, seen in list(self._peers.items()):
                        if now - seen > limit:
                            del self._peers[addr]
                            self._on_peer_dead(addr)
            except Exception:  # one bad message or peer must not end the thread
                logger.exception("%s: I/O loop error", self.name)
        for sock in self._push.values():
            sock.close(0)
        self._pull.close(0)
        self._ctx.term()


class _Side(abc.ABC):
    """What both ends share: the room table and per-room bookkeeping under one lock."""

    rooms: RoomTable
    _rooms: dict[int, Any]
    _lock: threading.Lock
    _link: _Link

    @property
    def control_addr(self) -> str:
        return self._link.addr

    @property
    def refused_messages(self) -> int:
        """Control messages dropped unread: unsigned, forged, replayed or malformed."""
        return self._link.refused

    def release(self, room: int) -> None:
        """The scheduler is done with a room: forget it once it has ended."""
        with self._lock:
            self._rooms.pop(room, None)
        self.rooms.close_if_ended(room)

    def _receive(self, msg: Any) -> None:
        """The I/O thread's entry: a handler that raises fails the room its message
        named (and tells the peer), never the thread."""
        try:
            self._on_message(msg)
        except Exception as exc:
            logger.exception("error handling %s", type(msg).__name__)
            room = getattr(msg, "room", None)
            if isinstance(room, int):
                self._fail_touched(room, msg, f"internal error handling {type(msg).__name__}: {exc}")

    def _unsendable(self, addr: str, msg: Any, reason: str) -> None:
        """The I/O thread could not send ``msg`` to ``addr`` (over the frame limit): fail its room."""
        room = getattr(msg, "room", None)
        if isinstance(room, int):
            try:
                self._fail_touched(room, msg, f"cannot send {type(msg).__name__}: {reason}")
            except Exception:
                logger.exception("failing room %d", room)

    @abc.abstractmethod
    def _on_message(self, msg: Any) -> None:
        """Act on one control message (the I/O thread)."""

    @abc.abstractmethod
    def _fail_touched(self, room: int, msg: Any, reason: str) -> None:
        """Fail ``room`` after handling ``msg`` raised, and tell the peer."""


# ---------------------------------------------------------------------------
# Prefill side
# ---------------------------------------------------------------------------


@dataclass
class _DecodePeer:
    handshake: P.Handshake
    plan: TransferPlan
    feature_plan: TransferPlan | None


@dataclass
class _PrefillRoom:
    # One transfer request per decode rank (a TP-n decode server sends n); the room
    # is ready once all of them arrived.
    requests: dict[str, P.TransferRequest]
    expected: int
    pending: int = 0                       # queued writes not yet done
    record: P.HandoffRecord | None = None  # set by finish(); sent once pending == 0
    bytes_sent: int = 0
    acked: bool = False                    # decode told that no write is left in flight
    released: bool = False                 # the scheduler is done; drop once pending == 0


class PrefillTransferManager(_Side):
    def __init__(self, engine: TransferEngine, compat: CompatRecord, layout: KVLayout, tp_rank: int,
                 head_ranges: Sequence[HeadRange] | None, host: str = "127.0.0.1",
                 cfg: LinkConfig = LinkConfig(),
                 provide_features: Callable[[tuple[int, ...], int], BufferSpec] | None = None) -> None:
        """``provide_features(layers, width)``: called at a handshake that needs target
        features this side does not publish; returns the (registered) buffer it will
        fill, or raises HandshakeError."""
        self.engine, self.compat, self.layout = engine, compat, layout
        self._provide_features = provide_features
        self.tp_rank, self.head_ranges = tp_rank, list(head_ranges) if head_ranges else None
        self.rooms = RoomTable(cfg.deadlines)
        self._peers: dict[str, _DecodePeer] = {}
        self._by_addr: dict[str, str] = {}
        self._rooms: dict[int, _PrefillRoom] = {}
        self._failed: dict[int, tuple[str, float]] = {}  # released failed room -> (reason, until), oldest first
        self._lock = threading.Lock()
        self._work: queue.Queue[tuple[str, int, Any] | None] = queue.Queue()
        self.bytes_sent = 0
        self.transfer_seconds = 0.0
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
            wanted = [n for n in hs.wanted if n != "features"]
            plan = plan_transfer(self.layout, hs.layout, wanted, self.tp_rank, self.head_ranges)
            feature_plan = None
            if "features" in hs.wanted and self.tp_rank == 0:
                # Features are the same on every rank (replicated hidden states): rank 0 sends them.
                feature_plan = self._feature_plan(hs)
        except HandshakeError as exc:
            self._link.send(hs.control_addr, P.HandshakeReply(self._link.addr, False, str(exc)))
            return
        with self._lock:
            self._peers[hs.decode_id] = _DecodePeer(hs, plan, feature_plan)
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
            self._peers.pop(decode_id, None)
            rooms = [r for r, pr in self._rooms.items() if decode_id in pr.requests]
        self.rooms.fail_all(f"decode server {addr} stopped answering heartbeats", "peer_dead", rooms)

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

    def send(self, room: int, src_slots: Sequence[int], first_position: int, ready: Any = None) -> None:
        """Queue the write of prompt positions [first_position, +len(src_slots)) of ``room``;
        ``ready`` (a CUDA event recorded after the forward that filled them) is waited
        for before the write reads them."""
        if self.rooms.get(room) is not None:  # rooms are only closed by this (the scheduler's) thread
            self.rooms.advance(room, RoomState.TRANSFERRING, only_from=RoomState.WAITING_FOR_INPUT)
        with self._lock:
            pr = self._rooms.get(room)
            if pr is None:
                raise RuntimeError(f"room {room}: send() before decode's transfer request")
            pr.pending += 1
        self._work.put(("write", room, (list(src_slots), first_position, ready)))

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

    def _write(self, room: int, src_slots: list[int], first: int, ready: Any = None) -> None:
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
                dst = request.dst_slots[start: start + len(src)]
                if len(dst) != len(src):
                    raise TransferError(f"positions {first}..{first + len(src_slots)} exceed the "
                                        f"{request.first_position} + {len(request.dst_slots)} positions decode "
                                        "holds and reserved")
                t0 = time.perf_counter()
                batch = peer.plan.writes(src, dst)
                if request.want_features and peer.feature_plan is not None:
                    extra = peer.feature_plan.writes(src, dst)
                    batch = type(batch)(batch.src + extra.src, batch.dst + extra.dst,
                                        batch.lengths + extra.lengths)
                if not batch.src:
                    continue  # this decode rank needs none of our heads
                self.engine.write(peer.handshake.session_id, batch)
                self.transfer_seconds += time.perf_counter() - t0
                self.bytes_sent += batch.nbytes
                pr.bytes_sent += batch.nbytes
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
        self._tell(room, P.HandoffRecord(**{**record.__dict__, "sender": self._link.addr}))
        self.rooms.advance(room, RoomState.SUCCESS)

    def close(self) -> None:
        self._work.put(None)
        self._worker.join(5)
        self._link.close()


# ---------------------------------------------------------------------------
# Decode side
# ---------------------------------------------------------------------------


@dataclass
class _PrefillPeer:
    info: P.RankInfo
    control_addr: str


@dataclass
class _DecodeRoom:
    senders: set[str] = field(default_factory=set)   # prefill control addrs still to report
    record: P.HandoffRecord | None = None
    quiet: set[str] = field(default_factory=set)     # senders that will not write any more


class DecodeTransferManager(_Side):
    def __init__(self, engine: TransferEngine, compat: CompatRecord, layout: KVLayout, tp_rank: int, tp_size: int,
                 wanted: Sequence[str], host: str = "127.0.0.1", cfg: LinkConfig = LinkConfig(),
                 feature_layers: tuple[int, ...] = ()) -> None:
        self.engine, self.compat, self.layout = engine, compat, layout
        self.feature_layers = feature_layers
        self.tp_rank, self.tp_size, self.wanted = tp_rank, tp_size, tuple(wanted)
        self.cfg = cfg
        self.decode_id = f"decode-{uuid.uuid4().hex[:12]}-r{tp_rank}"
        self.rooms = RoomTable(cfg.deadlines)
        self._rooms: dict[int, _DecodeRoom] = {}
        self._handshakes: dict[str, threading.Event] = {}
        self._handshake_error: dict[str, str] = {}
        self._connected: dict[str, list[_PrefillPeer]] = {}   # bootstrap url -> prefill ranks
        self._attempts: dict[str, tuple[str, str, float]] = {}  # bootstrap url -> (state, failure reason, when)
        # Connection attempts are bounded whatever the requests name: a few at a time
        # (the rest queue), and a server that just failed is not tried again at once.
        self._connect_queue: list[tuple[str, Callable[[], Sequence[P.RankInfo]]]] = []
        self._connecting = 0
        self._lock = threading.Lock()
        self._link = _Link(host, f"decode{tp_rank}", cfg, self._receive, self._on_peer_dead, self._unsendable)

    MAX_CONNECTING = 4
    RETRY_AFTER_S = 2.0

    def request_connect(self, bootstrap_url: str, fetch_ranks: Callable[[], Sequence[P.RankInfo]]) -> None:
        """Start connecting to a prefill server in the background (the scheduler loop
        never waits on a remote server): fetch its ranks from the bootstrap server,
        then handshake with each. A failed attempt is retried by a request arriving
        RETRY_AFTER_S later; at most MAX_CONNECTING attempts run at once."""
        now = time.monotonic()
        with self._lock:
            if bootstrap_url in self._connected:
                return
            attempt = self._attempts.get(bootstrap_url)
            if attempt is not None and (attempt[0] == "pending" or
                                        attempt[0] == "failed" and now - attempt[2] < self.RETRY_AFTER_S):
                return
            self._attempts[bootstrap_url] = ("pending", "", now)
            self._connect_queue.append((bootstrap_url, fetch_ranks))
            self._start_connecting()

    def _start_connecting(self) -> None:
        """Start queued attempts while fewer than MAX_CONNECTING run (lock held)."""
        while self._connect_queue and self._connecting < self.MAX_CONNECTING:
            url, fetch = self._connect_queue.pop(0)
            self._connecting += 1
            threading.Thread(target=self._attempt, args=(url, fetch), name=f"decode{self.tp_rank}-connect",
                             daemon=True).start()

    def _attempt(self, url: str, fetch_ranks: Callable[[], Sequence[P.RankInfo]]) -> None:
        try:
            self.connect(url, fetch_ranks())
            result = ("ok", "")
        except Exception as exc:  # reported to every request waiting on this server
            result = ("failed", f"cannot reach the prefill server at {url}: {exc}")
        with self._lock:
            self._attempts[url] = (*result, time.monotonic())
            self._connecting -= 1
            self._start_connecting()

    def connection(self, bootstrap_url: str) -> tuple[str, list[_PrefillPeer] | str]:
        """("ok", peers), ("pending", "") or ("failed", reason) for a prefill server."""
        with self._lock:
            peers = self._connected.get(bootstrap_url)
            if peers is not None:
                return "ok", peers
            state, reason, _ = self._attempts.get(bootstrap_url, ("failed", f"not connecting to {bootstrap_url}", 0.0))
            if state == "ok":  # connected, then its peer died: connect again
                return "failed", f"lost the prefill server at {bootstrap_url}"
            return state, reason

    def connect(self, bootstrap_url: str, ranks: Sequence[P.RankInfo]) -> list[_PrefillPeer]:
        """Handshake with every prefill rank of one prefill server (blocking, once)."""
        with self._lock:
            if bootstrap_url in self._connected:
                return self._connected[bootstrap_url]
        peers = []
        for info in ranks:
            addr = f"tcp://{info.host}:{info.port}"
            check_compatible(info.compat, self.compat)
            event = threading.Event()
            with self._lock:
                self._handshakes[addr] = event
            self._link.send(addr, P.Handshake(self.decode_id, self.tp_rank, self.tp_size, self.engine.session_id,
                                              self._link.addr, self.compat, self.layout, self.wanted,
                                              self.feature_layers))
            if not event.wait(self.cfg.handshake_timeout_s):
                raise HandshakeError(f"prefill rank {info.tp_rank} at {addr} did not answer the handshake within "
                                     f"{self.cfg.handshake_timeout_s:g} s (do both servers use the same "
                                     "--disaggregation-secret, or both none?)")
            err = self._handshake_error.pop(addr, None)
            if err:
                raise HandshakeError(err)
            self._link.watch(addr)
            peers.append(_PrefillPeer(info, addr))
        with self._lock:
            self._connected[bootstrap_url] = peers
        return peers

    def add_room(self, room: int, peers: Sequence[_PrefillPeer], dst_slots: Sequence[int],
                 want_features: bool = False, first_position: int = 0) -> None:
        """Reserve ``room``: tell every prefill rank where the KV of prompt positions
        ``first_position`` on goes (decode holds the ones before)."""
        self.rooms.open(room)
        with self._lock:
            self._rooms[room] = _DecodeRoom(senders={p.control_addr for p in peers})
        # Waiting before the first send: prefill may answer (its prompt already done)
        # before this thread runs again, and its record moves the room on.
        self.rooms.advance(room, RoomState.WAITING_FOR_INPUT)
        req = P.TransferRequest(room, self.decode_id, first_position, tuple(dst_slots), want_features)
        for p in peers:
            self._link.send(p.control_addr, req)

    def poll(self, room: int) -> tuple[RoomState, P.HandoffRecord | None, str | None]:
        r = self.rooms.get(room)
        if r is None:
            return RoomState.FAILED, None, f"unknown room {room}"
        with self._lock:
            dr = self._rooms.get(room)
            record = dr.record if dr else None
        return r.state, record if r.state is RoomState.SUCCESS else None, r.reason

    def abort(self, room: int, reason: str) -> None:
        if self.rooms.fail(room, reason, "aborted"):
            self._tell_senders(room, P.Abort(room, reason))

    def _tell_senders(self, room: int, msg: Any) -> None:
        with self._lock:
            dr = self._rooms.get(room)
            senders = list(dr.senders) if dr else []
        for addr in senders:
            self._link.send(addr, msg)

    def _fail_touched(self, room: int, msg: Any, reason: str) -> None:
        if self.rooms.fail(room, reason, "internal_error"):
            self._tell_senders(room, P.Abort(room, reason))

    def safe_to_free(self, room: int) -> bool:
        """Whether no prefill write can still land in the room's pages: it succeeded,
        or every sender acknowledged the failure (or died)."""
        r = self.rooms.get(room)
        if r is None or r.state is RoomState.SUCCESS:
            return True
        with self._lock:
            dr = self._rooms.get(room)
            return dr is None or dr.senders <= dr.quiet

    def expire(self) -> list[int]:
        """Fail rooms past their deadline and tell their prefill ranks, whose
        WritesDone then frees the pages."""
        failed = self.rooms.expire()
        for r in failed:
            self._tell_senders(r.room, P.Abort(r.room, r.reason or "timeout"))
        return [r.room for r in failed]

    # ---- I/O thread -------------------------------------------------------------------
    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, P.HandshakeReply):
            with self._lock:
                event = self._handshakes.get(msg.sender)
                if event is not None:
                    if not msg.ok:
                        self._handshake_error[msg.sender] = msg.error
                    event.set()
        elif isinstance(msg, P.HandoffRecord):
            with self._lock:
                dr = self._rooms.get(msg.room)
                if dr is None or msg.sender not in dr.senders:
                    return  # not ours, or a repeat: the room moved on at the first
                dr.senders.discard(msg.sender)
                if dr.record is None:  # every rank reports the same first token
                    dr.record = msg
                done = not dr.senders
            if done:
                self.rooms.advance(msg.room, RoomState.TRANSFERRING, only_from=RoomState.WAITING_FOR_INPUT)
                self.rooms.advance(msg.room, RoomState.SUCCESS, only_from=RoomState.TRANSFERRING)
        elif isinstance(msg, P.Abort):
            self.rooms.fail(msg.room, f"prefill failed the request: {msg.reason}", "prefill_error")
        elif isinstance(msg, P.WritesDone):
            with self._lock:
                dr = self._rooms.get(msg.room)
                if dr is not None and msg.sender in dr.senders:
                    dr.quiet.add(msg.sender)  # each prefill rank answers for its own writes only

    def _unsendable(self, addr: str, msg: Any, reason: str) -> None:
        if isinstance(msg, P.Handshake):  # the connecting thread hears it at once, not at its timeout
            with self._lock:
                event = self._handshakes.get(addr)
                if event is not None:
                    self._handshake_error[addr] = f"cannot send the handshake: {reason}"
                    event.set()
            return
        if isinstance(msg, P.TransferRequest):  # that rank never learns the pages: it cannot write them
            with self._lock:
                dr = self._rooms.get(msg.room)
                if dr is not None:
                    dr.quiet.add(addr)
        super()._unsendable(addr, msg, reason)

    def _on_peer_dead(self, addr: str) -> None:
        with self._lock:
            rooms = [r for r, dr in self._rooms.items() if addr in dr.senders]
            for r in rooms:
                self._rooms[r].quiet.add(addr)  # a dead sender writes nothing more
            for url, peers in list(self._connected.items()):
                if any(p.control_addr == addr for p in peers):
                    del self._connected[url]
        self.rooms.fail_all(f"prefill server {addr} stopped answering heartbeats", "peer_dead", rooms)

    def close(self) -> None:
        self._link.close()
