"""The decode end of a room's handoff: ``DecodeTransferManager``.

Split from ``manager.py`` (see there): the link (``link.py``) is shared, the two ends
are not. This end connects to prefill servers in the background (bounded: a few
attempts at a time, a failed server retried only after a pause), handshakes with each
prefill rank, tells every rank of a room where its KV goes (``add_room``) and collects
their handoff records (``poll``). Nothing the scheduler calls waits on the network.

Page safety across a failure: a failed room's pages stay out of use (``safe_to_free``)
until every prefill rank that could still write into them said ``WritesDone`` or died.
An ``Abort`` only says the room failed.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pdserve.disagg import protocol as P
from pdserve.disagg.layout import BufferSpec, CompatRecord, HandshakeError, KVLayout, check_compatible
from pdserve.disagg.link import LinkConfig, _Link, _Side
from pdserve.disagg.rooms import RoomState, RoomTable
from pdserve.disagg.transfer import TransferEngine

# The managers' messages keep the logger name they had before the split (log filters).
logger = logging.getLogger("pdserve.disagg.manager")


@dataclass
class PrefillPeer:
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
                 feature_layers: tuple[int, ...] = (), landing: BufferSpec | None = None) -> None:
        """``landing``: this rank's landing area (registered with ``engine``), published in
        the handshake; None: every request is written into its slots."""
        self.engine, self.compat, self.layout = engine, compat, layout
        self.landing = landing
        self.feature_layers = feature_layers
        self.tp_rank, self.tp_size, self.wanted = tp_rank, tp_size, tuple(wanted)
        self.cfg = cfg
        self.decode_id = f"decode-{uuid.uuid4().hex[:12]}-r{tp_rank}"
        self.rooms = RoomTable(cfg.deadlines)
        self.peers_lost = 0  # prefill ranks that stopped answering heartbeats
        self._rooms: dict[int, _DecodeRoom] = {}
        self._handshakes: dict[str, threading.Event] = {}
        self._handshake_error: dict[str, str] = {}
        self._connected: dict[str, list[PrefillPeer]] = {}   # bootstrap url -> prefill ranks
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

    def connection(self, bootstrap_url: str) -> tuple[str, list[PrefillPeer] | str]:
        """("ok", peers), ("pending", "") or ("failed", reason) for a prefill server."""
        with self._lock:
            peers = self._connected.get(bootstrap_url)
            if peers is not None:
                return "ok", peers
            state, reason, _ = self._attempts.get(bootstrap_url, ("failed", f"not connecting to {bootstrap_url}", 0.0))
            if state == "ok":  # connected, then its peer died: connect again
                return "failed", f"lost the prefill server at {bootstrap_url}"
            return state, reason

    def connect(self, bootstrap_url: str, ranks: Sequence[P.RankInfo]) -> list[PrefillPeer]:
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
                                              self.feature_layers, self.engine.metadata(), self.landing))
            if not event.wait(self.cfg.handshake_timeout_s):
                raise HandshakeError(f"prefill rank {info.tp_rank} at {addr} did not answer the handshake within "
                                     f"{self.cfg.handshake_timeout_s:g} s (do both servers use the same "
                                     "--disaggregation-secret, or both none?)")
            err = self._handshake_error.pop(addr, None)
            if err:
                raise HandshakeError(err)
            self._link.watch(addr)
            peers.append(PrefillPeer(info, addr))
        with self._lock:
            self._connected[bootstrap_url] = peers
        return peers

    def add_room(self, room: int, peers: Sequence[PrefillPeer], dst_slots: Sequence[int],
                 want_features: bool = False, first_position: int = 0, want_draft_state: bool = False,
                 landing_offset: int = -1) -> None:
        """Reserve ``room``: tell every prefill rank where the KV of prompt positions
        ``first_position`` on goes (decode holds the ones before; ``landing_offset`` >= 0:
        packed into that piece of the landing area, not into ``dst_slots``), and what
        else its draft needs: the target features, or the draft state prefill computed."""
        if landing_offset >= 0 and self.landing is None:
            raise ValueError("a landing piece, but this rank published no landing area")
        self.rooms.open(room)
        with self._lock:
            self._rooms[room] = _DecodeRoom(senders={p.control_addr for p in peers})
        # Waiting before the first send: prefill may answer (its prompt already done)
        # before this thread runs again, and its record moves the room on.
        self.rooms.advance(room, RoomState.WAITING_FOR_INPUT)
        req = P.TransferRequest(room, self.decode_id, first_position, tuple(dst_slots), want_features,
                                want_draft_state, landing_offset)
        for p in peers:
            self._link.send(p.control_addr, req)

    def shares_draft(self, peers: Sequence[PrefillPeer]) -> bool:
        """Whether every prefill rank of a connection runs this server's draft (same head,
        same top-k): its requests then start from the draft state prefill computed."""
        return bool(peers) and all(self.compat.shares_draft_with(p.info.compat) for p in peers)

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
            self.peers_lost += 1
        logger.warning("prefill server %s stopped answering heartbeats: %d room(s) with it failed", addr, len(rooms))
        self.rooms.fail_all(f"prefill server {addr} stopped answering heartbeats", "peer_dead", rooms)

    def close(self) -> None:
        self._link.close()
