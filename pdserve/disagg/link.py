"""The control link both transfer managers stand on: one I/O thread per side.

Split from ``manager.py`` (see there) along the line between the *wire* and the *room
logic*: this module owns sockets, signing, heartbeats and the thread that drives them,
and knows nothing of what a prefill or decode side does with a message. The two
managers (``prefill_manager.py``, ``decode_manager.py``) each build one ``_Link`` and
subclass ``_Side``, which turns what the link reports (a message, a dead peer, a message
too large to send) into per-room failures with a reason.

Each side owns one control socket (a ZMQ PULL it binds) and one I/O thread that owns
every socket: it receives messages, sends queued ones, and sends and checks heartbeats.
Nothing a scheduler calls waits on the network: sends are queued and wake the thread
through a pipe. A handler that raises fails the room its message named (both sides hear
of it), never the thread.
"""

from __future__ import annotations

import abc
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from pdserve.disagg import protocol as P
from pdserve.disagg.rooms import Deadlines, RoomTable

# The managers' messages keep the logger name they had before the split (log filters).
logger = logging.getLogger("pdserve.disagg.manager")


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
