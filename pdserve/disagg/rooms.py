"""The per-server table of transfer rooms and their state machine.

A room is one request sample's handoff, keyed by the router's 63-bit
``bootstrap_room``.  States only move forward:

    BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS
          \\________________\\___________________\\______-> FAILED

FAILED is absorbing and carries the reason the client will see; every
non-terminal state has a deadline, so nothing waits forever (SGLang's
Transferring state has none).  A room number that is still live is refused
rather than merged into.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


class RoomState(enum.IntEnum):
    BOOTSTRAPPING = 0
    WAITING_FOR_INPUT = 1
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4

    @property
    def terminal(self) -> bool:
        return self in (RoomState.SUCCESS, RoomState.FAILED)


class RoomError(RuntimeError):
    pass


@dataclass
class Room:
    room: int
    state: RoomState
    entered: float                       # when the current state began
    reason: str | None = None            # why it failed
    history: list[tuple[RoomState, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Deadlines:
    """Seconds a room may stay in each non-terminal state."""
    bootstrapping: float = 30.0
    waiting_for_input: float = 120.0
    transferring: float = 60.0

    def of(self, state: RoomState) -> float:
        return {RoomState.BOOTSTRAPPING: self.bootstrapping, RoomState.WAITING_FOR_INPUT: self.waiting_for_input,
                RoomState.TRANSFERRING: self.transferring}[state]


class RoomTable:
    """Thread-safe: the scheduler loop and the transfer threads both touch rooms."""

    def __init__(self, deadlines: Deadlines = Deadlines(), clock: Callable[[], float] = time.monotonic) -> None:
        self.deadlines = deadlines
        self.clock = clock
        self._rooms: dict[int, Room] = {}
        self._lock = threading.Lock()
        self.failures: dict[str, int] = {}   # failure counts by reason kind (metrics)

    def open(self, room: int) -> Room:
        r, opened = self.open_or_join(room)
        if not opened:
            raise RoomError(f"bootstrap_room {room} is already in use by a live request")
        return r

    def open_or_join(self, room: int) -> tuple[Room, bool]:
        """The live room of that number, else a fresh one; and whether it is fresh. One
        step under the lock: on prefill the request and decode's transfer request arrive
        on different threads, and whichever comes first opens the room."""
        if not 0 <= room < 2**63:
            raise RoomError(f"bootstrap_room must be in [0, 2^63), got {room}")
        with self._lock:
            old = self._rooms.get(room)
            if old is not None and not old.state.terminal:
                return old, False
            now = self.clock()
            r = Room(room, RoomState.BOOTSTRAPPING, now, history=[(RoomState.BOOTSTRAPPING, now)])
            self._rooms[room] = r
            return r, True

    def get(self, room: int) -> Room | None:
        with self._lock:
            return self._rooms.get(room)

    def advance(self, room: int, state: RoomState, only_from: RoomState | None = None) -> bool:
        """Move forward; False (and no change) when the room already failed, or is not in
        ``only_from`` when that is given (a check and a move in one step: another thread
        may move the room between a separate check and the move). Moving backwards or
        out of SUCCESS is a bug and raises."""
        with self._lock:
            if state is RoomState.FAILED:
                raise RoomError("use fail() with a reason")
            r = self._need(room)
            if r.state is RoomState.FAILED or (only_from is not None and r.state is not only_from):
                return False
            if state <= r.state or r.state is RoomState.SUCCESS:
                raise RoomError(f"room {room}: {r.state.name} -> {state.name} goes backwards")
            now = self.clock()
            r.state, r.entered = state, now
            r.history.append((state, now))
            return True

    def fail(self, room: int, reason: str, kind: str = "error") -> bool:
        """Fail a live room (False when it had already ended)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.state.terminal:
                return False
            self._fail(r, reason, kind)
            return True

    def _fail(self, r: Room, reason: str, kind: str) -> None:
        now = self.clock()
        r.state, r.entered, r.reason = RoomState.FAILED, now, reason
        r.history.append((RoomState.FAILED, now))
        self.failures[kind] = self.failures.get(kind, 0) + 1

    def expire(self) -> list[Room]:
        """Fail every room that outstayed its state's deadline; returns them."""
        now = self.clock()
        out = []
        with self._lock:
            for r in self._rooms.values():
                if r.state.terminal:
                    continue
                limit = self.deadlines.of(r.state)
                if now - r.entered > limit:
                    self._fail(r, f"{r.state.name.lower()} exceeded its {limit:g} s deadline", "timeout")
                    out.append(r)
        return out

    def fail_all(self, reason: str, kind: str, rooms: list[int] | None = None) -> list[Room]:
        """Fail the given live rooms (all when None): a dead peer, a shutdown."""
        with self._lock:
            targets = [r for r in self._rooms.values() if (rooms is None or r.room in rooms) and not r.state.terminal]
            for r in targets:
                self._fail(r, reason, kind)
            return targets

    def close(self, room: int) -> None:
        """Forget a room that has ended."""
        with self._lock:
            r = self._need(room)
            if not r.state.terminal:
                raise RoomError(f"room {room} is still {r.state.name}")
            del self._rooms[room]

    def close_if_ended(self, room: int) -> bool:
        """Forget the room if it has ended (one step: a transfer thread may open the same
        number again between a separate check and the close)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or not r.state.terminal:
                return False
            del self._rooms[room]
            return True

    def ended(self) -> list[int]:
        """Rooms in a terminal state (to be closed by whoever owns them)."""
        with self._lock:
            return [r.room for r in self._rooms.values() if r.state.terminal]

    def counts(self) -> dict[str, int]:
        with self._lock:
            out = {s.name.lower(): 0 for s in RoomState}
            for r in self._rooms.values():
                out[r.state.name.lower()] += 1
            return out

    def _need(self, room: int) -> Room:
        r = self._rooms.get(room)
        if r is None:
            raise RoomError(f"unknown room {room}")
        return r
