"""The signed control link between live transfer managers (real ZMQ sockets, a shared
secret): the handoff works signed; a message sealed for one prefill server is refused
by another of the same deployment; a frame over the link's limit is dropped by libzmq
before Python sees it, and one the link would have to send fails its room by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import zmq

from pdserve.disagg import protocol as P
from pdserve.disagg.manager import DecodeTransferManager, PrefillTransferManager
from pdserve.disagg.rooms import RoomState
from pdserve.disagg.transfer import LocalTransfer
from tests.disagg.test_manager import COMPAT, FAST, buffers
from tests.waiting import wait_until

pytestmark = pytest.mark.fast

SECRET = b"a-deployment-secret-for-link-tests"
SIGNED = dataclasses.replace(FAST, secret=SECRET)
NAMES = ["target.L0.K", "target.L0.V"]


@pytest.fixture
def signed_pair():
    src, src_layout = buffers()
    dst, dst_layout = buffers(0.0)
    pre = PrefillTransferManager(LocalTransfer(), COMPAT, src_layout, 0, None, cfg=SIGNED)
    dec = DecodeTransferManager(LocalTransfer(), COMPAT, dst_layout, 0, 1, NAMES, cfg=SIGNED)
    peers = dec.connect("bootstrap", [pre.rank_info(1, "127.0.0.1")])
    yield pre, dec, peers, src, dst
    dec.close()
    pre.close()


def handoff(pre, dec, peers, src, dst, room: int) -> None:
    pre.open(room)
    dec.add_room(room, peers, dst_slots=[20, 21, 22])
    assert wait_until(lambda: pre.ready(room))
    pre.send(room, [3, 4, 5], 0)
    pre.finish(room, P.HandoffRecord(room, "", first_token=11))
    assert wait_until(lambda: dec.poll(room)[0] is RoomState.SUCCESS)
    assert dec.poll(room)[1].first_token == 11
    for name in src:
        assert torch.equal(dst[name][20:23], src[name][3:6])


def push(addr: str, *frames: bytes) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(addr)
    for f in frames:
        sock.send(f)
    sock.close(linger=5000)
    ctx.term()


def test_signed_handoff_and_heartbeats(signed_pair):
    pre, dec, peers, src, dst = signed_pair
    handoff(pre, dec, peers, src, dst, 1)
    handoff(pre, dec, peers, src, dst, 2)
    assert pre.refused_messages == 0 and dec.refused_messages == 0   # heartbeats included


def test_a_message_sealed_for_one_prefill_server_is_refused_by_another(signed_pair):
    """Prefill servers A and B share the secret; an Abort signed for A (captured on its
    way, or sent by a holder of the secret to A) does nothing on B."""
    pre_a, dec, peers, src, dst = signed_pair
    _, layout_b = buffers()
    pre_b = PrefillTransferManager(LocalTransfer(), COMPAT, layout_b, 0, None, cfg=SIGNED)
    try:
        for pre in (pre_a, pre_b):
            pre.open(9)
        sealer = P.Authenticator(SECRET, dec.control_addr)
        for_a = P.encode(P.Abort(9, "meant for A"), sealer, to=pre_a.control_addr)
        push(pre_b.control_addr, for_a)
        assert wait_until(lambda: pre_b.refused_messages == 1)
        assert pre_b.status(9)[0] is RoomState.BOOTSTRAPPING
        push(pre_a.control_addr, for_a)
        assert wait_until(lambda: pre_a.status(9)[0] is RoomState.FAILED)
        assert "meant for A" in pre_a.status(9)[1] and pre_a.refused_messages == 0
    finally:
        pre_b.close()
    handoff(pre_a, dec, peers, src, dst, 10)


def test_an_oversize_frame_is_dropped_before_python_sees_it(monkeypatch):
    """With the link's limit at 64 KiB: a 1 MiB frame never reaches the decoder (libzmq
    drops it with its connection, MAXMSGSIZE); the link goes on working. A message the
    link itself would have to send above the limit is not sent: its room fails with
    the reason and its pages are free at once (no prefill rank ever heard of them)."""
    cfg = dataclasses.replace(SIGNED, max_message_bytes=64 << 10)
    src, src_layout = buffers()
    dst, dst_layout = buffers(0.0)
    pre = PrefillTransferManager(LocalTransfer(), COMPAT, src_layout, 0, None, cfg=cfg)
    dec = DecodeTransferManager(LocalTransfer(), COMPAT, dst_layout, 0, 1, NAMES, cfg=cfg)
    seen: list[int] = []
    decode = P.decode

    def counting_decode(data, *a, **k):
        seen.append(len(data))
        return decode(data, *a, **k)
    monkeypatch.setattr(P, "decode", counting_decode)
    try:
        peers = dec.connect("b", [pre.rank_info(1, "127.0.0.1")])
        forger = P.Authenticator(b"not-the-deployment-secret", "x")
        big = P.encode(P.Abort(1, "x" * (1 << 20)), forger, to=dec.control_addr, max_bytes=1 << 30)
        small = P.encode(P.Abort(1, "small"), forger, to=dec.control_addr)
        push(dec.control_addr, big)
        push(dec.control_addr, small)
        assert wait_until(lambda: dec.refused_messages == 1)   # the small one; the big one never arrived
        assert max(seen) <= 64 << 10 and len(big) not in seen
        handoff(pre, dec, peers, src, dst, 3)
        # 10,000 slots: a TransferRequest of ~110 KB, over this link's 64 KiB.
        dec.add_room(4, peers, dst_slots=range(10**9, 10**9 + 10_000))
        assert wait_until(lambda: dec.poll(4)[0] is RoomState.FAILED)
        assert "cannot send TransferRequest" in dec.poll(4)[2] and "frame limit" in dec.poll(4)[2]
        assert dec.safe_to_free(4)
        handoff(pre, dec, peers, src, dst, 5)
    finally:
        dec.close()
        pre.close()
