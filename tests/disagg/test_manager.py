"""Prefill and decode transfer managers over real ZMQ sockets (in one process, with the
in-process memcpy engine): the handoff, handshake refusals, aborts both ways, a dead
peer detected by heartbeats, a failed write, deadlines. Every failure carries a reason."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.disagg import protocol as P
from pdserve.disagg.layout import PROTOCOL_VERSION, BufferSpec, CompatRecord, HandshakeError, KVLayout
from pdserve.disagg.manager import DecodeTransferManager, LinkConfig, PrefillTransferManager
from pdserve.disagg.rooms import Deadlines, RoomState
from pdserve.disagg.transfer import LocalTransfer, TransferError
from tests.waiting import wait_until as wait_for

pytestmark = pytest.mark.fast

SLOTS, WIDTH = 64, 8
COMPAT = CompatRecord(PROTOCOL_VERSION, "LlamaForCausalLM", 1, 2, 4, "float32", 1, 104)
FAST = LinkConfig(heartbeat_interval_s=0.1, heartbeat_misses=3, handshake_timeout_s=3,
                  deadlines=Deadlines(bootstrapping=2, waiting_for_input=2, transferring=2))


def buffers(fill=None):
    out = {n: (torch.randn(SLOTS, WIDTH) if fill is None else torch.full((SLOTS, WIDTH), fill))
           for n in ("target.L0.K", "target.L0.V")}
    return out, KVLayout(1, tuple(BufferSpec(n, t.data_ptr(), SLOTS, WIDTH * 4) for n, t in out.items()))


@pytest.fixture
def pair():
    src, src_layout = buffers()
    dst, dst_layout = buffers(0.0)
    pre = PrefillTransferManager(LocalTransfer(), COMPAT, src_layout, 0, None, cfg=FAST)
    dec = DecodeTransferManager(LocalTransfer(), COMPAT, dst_layout, 0, 1, ["target.L0.K", "target.L0.V"], cfg=FAST)
    peers = dec.connect("bootstrap", [pre.rank_info(1, "127.0.0.1")])
    yield pre, dec, peers, src, dst
    dec.close()
    pre.close()


def test_handoff_in_chunks(pair):
    pre, dec, peers, src, dst = pair
    pre.open(42)
    dec.add_room(42, peers, dst_slots=list(range(30, 40)))
    assert wait_for(lambda: pre.ready(42))
    pre.send(42, [0, 1, 2, 3], 0)          # chunk 1: positions 0..3
    pre.send(42, [9, 8, 7, 6, 5, 4], 4)    # chunk 2: positions 4..9
    pre.finish(42, P.HandoffRecord(42, "", first_token=17, logprob=-0.5, cached_tokens=3))
    assert wait_for(lambda: dec.poll(42)[0] is RoomState.SUCCESS)
    state, record, _ = dec.poll(42)
    assert (record.first_token, record.logprob, record.cached_tokens) == (17, -0.5, 3)
    for name in src:
        assert torch.equal(dst[name][30:40], src[name][[0, 1, 2, 3, 9, 8, 7, 6, 5, 4]])
        assert not dst[name][:30].any() and not dst[name][40:].any()
    assert pre.status(42)[0] is RoomState.SUCCESS and pre.bytes_by_kind["target_kv"] == 2 * 10 * WIDTH * 4
    assert pre.bytes_by_kind["metadata"] == len(P.encode(record)) and pre.bytes_by_kind["features"] == 0
    assert pre.bytes_sent == 2 * 10 * WIDTH * 4 + len(P.encode(record))
    pre.release(42)
    dec.release(42)
    assert dec.rooms.counts()["success"] == 0
    # A room number may be used again once it ended; a live one may not.
    dec.add_room(42, peers, dst_slots=[1])
    with pytest.raises(Exception, match="already in use"):
        dec.add_room(42, peers, dst_slots=[2])


def test_record_arriving_before_add_room_returns(pair):
    """Prefill finished its prompt before decode asked: its record can come back before the
    thread that sent the transfer request runs again (seen under load as a decode
    scheduler dying on "SUCCESS -> WAITING_FOR_INPUT goes backwards"). Here the send
    itself waits for the record; add_room must still return, the room a success."""
    import threading
    pre, dec, peers, src, dst = pair
    pre.open(7)

    def prefill_side() -> None:
        assert wait_for(lambda: pre.ready(7))
        pre.send(7, [0, 1, 2], 0)
        pre.finish(7, P.HandoffRecord(7, "", first_token=3, logprob=-0.1, cached_tokens=0))
    sender = threading.Thread(target=prefill_side)
    sender.start()
    send = dec._link.send

    def send_then_wait_for_record(addr, msg):
        send(addr, msg)
        if isinstance(msg, P.TransferRequest):
            assert wait_for(lambda: dec.rooms.get(7).state is RoomState.SUCCESS)
    dec._link.send = send_then_wait_for_record
    dec.add_room(7, peers, dst_slots=[10, 11, 12])
    sender.join(5)
    state, record, _ = dec.poll(7)
    assert state is RoomState.SUCCESS and record.first_token == 3
    assert [s for s, _ in dec.rooms.get(7).history] == list(RoomState)[:4]
    for name in src:
        assert torch.equal(dst[name][10:13], src[name][0:3])
    # A repeated record (a resend, a duplicate on the wire) changes nothing and raises nothing.
    dec._on_message(P.HandoffRecord(7, peers[0].control_addr, first_token=99, logprob=0.0, cached_tokens=0))
    assert dec.poll(7)[0] is RoomState.SUCCESS and dec.poll(7)[1].first_token == 3


def test_incompatible_pair_refused_at_handshake():
    src, src_layout = buffers()
    dst, dst_layout = buffers(0.0)
    pre = PrefillTransferManager(LocalTransfer(), COMPAT, src_layout, 0, None, cfg=FAST)
    other = CompatRecord(**{**COMPAT.__dict__, "page_size": 16})
    dec = DecodeTransferManager(LocalTransfer(), other, dst_layout, 0, 1, ["target.L0.K"], cfg=FAST)
    try:
        with pytest.raises(HandshakeError, match="page_size: 1 vs 16"):
            dec.connect("b", [pre.rank_info(1, "127.0.0.1")])
        # Decode asking for a buffer prefill lacks: refused by prefill, reason relayed. (Draft
        # KV buffers are asked for only when both sides run the same draft: not refused.)
        dec2 = DecodeTransferManager(LocalTransfer(), COMPAT, dst_layout, 0, 1, ["target.L9.K"], cfg=FAST)
        with pytest.raises(HandshakeError, match="target.L9.K"):
            dec2.connect("b", [pre.rank_info(1, "127.0.0.1")])
        dec2.close()
    finally:
        dec.close()
        pre.close()


def test_abort_both_ways(pair):
    pre, dec, peers, src, dst = pair
    pre.open(1)
    dec.add_room(1, peers, dst_slots=[5, 6])
    assert wait_for(lambda: pre.ready(1))
    dec.abort(1, "client disconnected")
    assert wait_for(lambda: pre.status(1)[0] is RoomState.FAILED)
    assert "client disconnected" in pre.status(1)[1]
    pre.open(2)
    dec.add_room(2, peers, dst_slots=[7])
    assert wait_for(lambda: pre.ready(2))
    pre.abort(2, "prefill out of memory")
    assert wait_for(lambda: dec.poll(2)[0] is RoomState.FAILED)
    assert "prefill out of memory" in dec.poll(2)[2]


def test_dead_prefill_fails_rooms_within_heartbeat_deadline(pair):
    pre, dec, peers, src, dst = pair
    pre.open(3)
    dec.add_room(3, peers, dst_slots=[1, 2])
    assert wait_for(lambda: pre.ready(3))
    t0 = time.monotonic()
    pre.close()  # no more heartbeats
    assert wait_for(lambda: dec.poll(3)[0] is RoomState.FAILED, timeout=3)
    assert time.monotonic() - t0 < 5.0  # nothing else fails it: without heartbeats it would wait forever
    assert "stopped answering heartbeats" in dec.poll(3)[2]


def test_dead_decode_fails_prefill_rooms(pair):
    pre, dec, peers, src, dst = pair
    pre.open(4)
    dec.add_room(4, peers, dst_slots=[1])
    assert wait_for(lambda: pre.ready(4))
    dec.close()
    assert wait_for(lambda: pre.status(4)[0] is RoomState.FAILED, timeout=3)
    assert "stopped answering heartbeats" in pre.status(4)[1]


class BrokenEngine(LocalTransfer):
    def write(self, peer_session, batch):
        raise TransferError("link down")


def test_write_error_fails_the_room_on_both_sides():
    src, src_layout = buffers()
    dst, dst_layout = buffers(0.0)
    pre = PrefillTransferManager(BrokenEngine(), COMPAT, src_layout, 0, None, cfg=FAST)
    dec = DecodeTransferManager(LocalTransfer(), COMPAT, dst_layout, 0, 1, ["target.L0.K"], cfg=FAST)
    try:
        peers = dec.connect("b", [pre.rank_info(1, "127.0.0.1")])
        pre.open(5)
        dec.add_room(5, peers, dst_slots=[1, 2])
        assert wait_for(lambda: pre.ready(5))
        pre.send(5, [3, 4], 0)
        pre.finish(5, P.HandoffRecord(5, "", 1))
        assert wait_for(lambda: dec.poll(5)[0] is RoomState.FAILED)
        assert "link down" in dec.poll(5)[2] and "link down" in pre.status(5)[1]
        # The failed write was the room's last: prefill says so, decode may reuse the pages.
        assert wait_for(lambda: dec.safe_to_free(5))
        # The transfer thread survived: the next room works up to the write.
        pre.open(6)
        dec.add_room(6, peers, dst_slots=[1])
        assert wait_for(lambda: pre.ready(6))
    finally:
        dec.close()
        pre.close()


def test_rooms_time_out_with_a_reason(pair):
    pre, dec, peers, src, dst = pair
    dec.add_room(9, peers, dst_slots=[1])  # prefill never gets the request
    assert wait_for(lambda: bool(dec.expire()), timeout=4)
    state, _, reason = dec.poll(9)
    assert state is RoomState.FAILED and "waiting_for_input exceeded its 2 s deadline" in reason


class BlockingEngine(LocalTransfer):
    """A transfer engine whose writes wait until the test lets them go."""

    def __init__(self) -> None:
        super().__init__()
        import threading
        self.entered = threading.Event()
        self.go = threading.Event()

    def write(self, peer_session, batch):
        self.entered.set()
        assert self.go.wait(10), "the test never released the write"
        super().write(peer_session, batch)


@pytest.mark.parametrize("how", ["abort", "expire", "release"])
def test_prefill_side_failure_keeps_decode_pages_until_the_write_returned(how):
    """A failure prefill starts (a client abort of the prefill leg, a deadline) while its
    transfer thread is inside a write for the room: decode hears of the failure at once,
    but may reuse the room's pages only after that write has returned, told by a message
    from that sender; an Abort is no such acknowledgement."""
    src, src_layout = buffers()
    dst, dst_layout = buffers(0.0)
    engine = BlockingEngine()
    cfg = FAST if how != "expire" else LinkConfig(heartbeat_interval_s=0.1, heartbeat_misses=30, handshake_timeout_s=3,
                                                  deadlines=Deadlines(bootstrapping=2, waiting_for_input=2,
                                                                      transferring=0.5))
    pre = PrefillTransferManager(engine, COMPAT, src_layout, 0, None, cfg=cfg)
    dec = DecodeTransferManager(LocalTransfer(), COMPAT, dst_layout, 0, 1, ["target.L0.K", "target.L0.V"], cfg=FAST)
    try:
        peers = dec.connect("b", [pre.rank_info(1, "127.0.0.1")])
        pre.open(11)
        dec.add_room(11, peers, dst_slots=[20, 21, 22])
        assert wait_for(lambda: pre.ready(11))
        pre.send(11, [0, 1, 2], 0)
        assert engine.entered.wait(5)
        if how == "expire":
            assert wait_for(lambda: bool(pre.expire()), timeout=5)
        else:
            pre.abort(11, "aborted by the client")
        if how == "release":  # the prefill scheduler forgets the room at once
            pre.release(11)
        # The Abort that failed the room is what used to free the pages (in the same handler).
        assert wait_for(lambda: dec.poll(11)[0] is RoomState.FAILED)
        assert not dec.safe_to_free(11), "decode pages freed while prefill's write is in flight"
        engine.go.set()
        assert wait_for(lambda: dec.safe_to_free(11)), "the write returned but decode was never told"
    finally:
        engine.go.set()
        dec.close()
        pre.close()


def test_a_failing_message_handler_fails_the_room_it_touched(pair):
    """An exception while handling a message fails the room the message named (on both
    sides: the peer is told), and the I/O thread keeps serving other rooms."""
    pre, dec, peers, src, dst = pair

    def broken(msg):
        if msg.room == 12:
            raise RuntimeError("handler bug")
        return original(msg)
    original = pre._transfer_request
    pre._transfer_request = broken
    pre.open(12)
    dec.add_room(12, peers, dst_slots=[1, 2])
    assert wait_for(lambda: pre.status(12)[0] is RoomState.FAILED)
    assert "handler bug" in pre.status(12)[1]
    assert wait_for(lambda: dec.poll(12)[0] is RoomState.FAILED)
    assert "handler bug" in dec.poll(12)[2]
    pre.open(13)
    dec.add_room(13, peers, dst_slots=[3])
    assert wait_for(lambda: pre.ready(13))


def test_a_late_transfer_request_for_a_room_prefill_already_failed_is_answered_at_once(pair):
    """Prefill failed and forgot a room before decode asked for it (a client abort of the
    prefill leg, a prefill-side error): decode's late request is answered with the reason
    and WritesDone at once, not left to open a room nobody computes (120 s of waiting)."""
    pre, dec, peers, src, dst = pair
    pre.open(21)
    pre.abort(21, "aborted by the client")
    pre.release(21)
    dec.add_room(21, peers, dst_slots=[1, 2])
    assert wait_for(lambda: dec.poll(21)[0] is RoomState.FAILED, timeout=5)
    assert "aborted by the client" in dec.poll(21)[2]
    assert wait_for(lambda: dec.safe_to_free(21), timeout=5)
    assert pre.rooms.get(21) is None  # nothing was opened for it
    # The number can be used again by a new prefill request.
    pre.open(21)
    dec.release(21)
    dec.add_room(21, peers, dst_slots=[3])
    assert wait_for(lambda: pre.ready(21))


def test_connection_attempts_are_bounded_whatever_requests_name():
    """Requests naming many prefill servers start at most a few connection attempts at
    once (the rest queue), and a server that just failed is not tried again at once."""
    import threading
    dst, dst_layout = buffers(0.0)
    dec = DecodeTransferManager(LocalTransfer(), COMPAT, dst_layout, 0, 1, ["target.L0.K"], cfg=FAST)
    release, running, peak, calls = threading.Event(), [0], [0], []
    lock = threading.Lock()

    def fetch(url):
        def ranks():
            with lock:
                calls.append(url)
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            release.wait(10)
            with lock:
                running[0] -= 1
            raise TransferError("no such server")
        return ranks
    try:
        urls = [f"http://10.0.0.{i}:8998" for i in range(20)]
        for url in urls:
            dec.request_connect(url, fetch(url))
        assert wait_for(lambda: len(calls) == dec.MAX_CONNECTING)
        release.set()
        assert wait_for(lambda: all(dec.connection(u)[0] == "failed" for u in urls))
        assert peak[0] == dec.MAX_CONNECTING and len(calls) == 20
        dec.request_connect(urls[0], fetch(urls[0]))  # just failed: answered with that failure
        assert dec.connection(urls[0])[0] == "failed" and len(calls) == 20
    finally:
        release.set()
        dec.close()
