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

The code is in three modules, split where the threads and the two ends split:

- ``link.py``: ``LinkConfig`` and the I/O thread (sockets, signing, heartbeats),
  with ``_Side``, what both ends do with what the link reports. It knows no room
  logic of either end.
- ``prefill_manager.py``: ``PrefillTransferManager``, its peers, rooms and the
  transfer thread.
- ``decode_manager.py``: ``DecodeTransferManager``, its background connections,
  rooms and page safety.

The two ends only ever talk through the link's messages, so neither module imports
the other. The public names stay importable from here, where the schedulers, the
server builder and the tests import them.
"""

from __future__ import annotations

from pdserve.disagg.decode_manager import DecodeTransferManager
from pdserve.disagg.link import LinkConfig
from pdserve.disagg.prefill_manager import PrefillTransferManager

__all__ = ["DecodeTransferManager", "LinkConfig", "PrefillTransferManager"]
