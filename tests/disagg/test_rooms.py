"""The room state machine: forward only, FAILED absorbing with its reason, a deadline in
every non-terminal state, duplicate live rooms refused."""

from __future__ import annotations

import pytest

from pdserve.disagg.rooms import Deadlines, RoomError, RoomState, RoomTable

pytestmark = pytest.mark.fast


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def table() -> tuple[RoomTable, Clock]:
    clock = Clock()
    return RoomTable(Deadlines(bootstrapping=5, waiting_for_input=10, transferring=3), clock), clock


def test_happy_path_and_counts():
    t, clock = table()
    t.open(7)
    for s in (RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING, RoomState.SUCCESS):
        clock.t += 1
        assert t.advance(7, s)
    assert [s for s, _ in t.get(7).history] == list(RoomState)[:4]
    assert t.counts()["success"] == 1
    t.close(7)
    assert t.get(7) is None


def test_states_only_move_forward_and_failed_absorbs():
    t, _ = table()
    t.open(1)
    t.advance(1, RoomState.TRANSFERRING)  # skipping a state forward is allowed
    with pytest.raises(RoomError, match="backwards"):
        t.advance(1, RoomState.WAITING_FOR_INPUT)
    assert t.fail(1, "decode died", "peer_dead")
    assert not t.advance(1, RoomState.SUCCESS)          # stays failed
    assert not t.fail(1, "second reason")               # the first reason stays
    assert t.get(1).reason == "decode died" and t.failures == {"peer_dead": 1}
    with pytest.raises(RoomError, match="reason"):
        t.advance(1, RoomState.FAILED)


@pytest.mark.parametrize("state,limit", [(RoomState.BOOTSTRAPPING, 5), (RoomState.WAITING_FOR_INPUT, 10),
                                         (RoomState.TRANSFERRING, 3)])
def test_every_live_state_has_a_deadline(state, limit):
    t, clock = table()
    t.open(3)
    if state is not RoomState.BOOTSTRAPPING:
        t.advance(3, state)
    clock.t += limit
    assert t.expire() == []
    clock.t += 0.01
    (r,) = t.expire()
    assert r.state is RoomState.FAILED and state.name.lower() in r.reason and f"{limit:g} s" in r.reason
    assert t.failures == {"timeout": 1}


def test_duplicate_live_room_is_refused_but_ended_room_can_be_reused():
    t, _ = table()
    t.open(2**63 - 1)
    with pytest.raises(RoomError, match="already in use"):
        t.open(2**63 - 1)
    t.fail(2**63 - 1, "aborted")
    t.open(2**63 - 1)
    for bad in (-1, 2**63):
        with pytest.raises(RoomError, match="2\\^63"):
            t.open(bad)
    with pytest.raises(RoomError, match="still"):
        t.close(2**63 - 1)


def test_fail_all_for_a_dead_peer():
    t, _ = table()
    for room in (1, 2, 3):
        t.open(room)
    t.advance(3, RoomState.TRANSFERRING)
    t.advance(3, RoomState.SUCCESS)
    failed = t.fail_all("prefill stopped answering heartbeats", "peer_dead", rooms=[1, 3])
    assert [r.room for r in failed] == [1]
    assert t.counts() == {"bootstrapping": 1, "waiting_for_input": 0, "transferring": 0, "success": 1, "failed": 1}


def test_open_or_join_opens_once_across_threads():
    """On prefill the request and decode's transfer request open the same room from two
    threads; exactly one of them opens it, the other joins (neither raises)."""
    import threading
    t, _ = table()
    for room in range(200):
        fresh: list[bool] = []
        start = threading.Barrier(2)

        def arrive() -> None:
            start.wait()
            fresh.append(t.open_or_join(room)[1])
        threads = [threading.Thread(target=arrive) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert sorted(fresh) == [False, True], room
    t.fail(5, "aborted")
    assert t.open_or_join(5)[1]  # an ended room number opens afresh


def test_advance_only_from_is_one_step():
    t, _ = table()
    t.open(1)
    assert not t.advance(1, RoomState.TRANSFERRING, only_from=RoomState.WAITING_FOR_INPUT)
    assert t.get(1).state is RoomState.BOOTSTRAPPING
    assert t.advance(1, RoomState.WAITING_FOR_INPUT, only_from=RoomState.BOOTSTRAPPING)
    assert t.advance(1, RoomState.TRANSFERRING, only_from=RoomState.WAITING_FOR_INPUT)
    assert t.advance(1, RoomState.SUCCESS, only_from=RoomState.TRANSFERRING)
    # Already past it: no move, and not the "goes backwards" error a plain advance raises.
    assert not t.advance(1, RoomState.TRANSFERRING, only_from=RoomState.WAITING_FOR_INPUT)
    assert t.get(1).state is RoomState.SUCCESS


def test_close_if_ended_keeps_live_rooms():
    t, _ = table()
    t.open(4)
    assert not t.close_if_ended(4) and t.get(4) is not None   # live: kept
    t.fail(4, "aborted")
    t.open_or_join(4)                                          # reopened by another thread
    assert not t.close_if_ended(4) and t.get(4).state is RoomState.BOOTSTRAPPING
    t.fail(4, "aborted")
    assert t.close_if_ended(4) and t.get(4) is None
    assert not t.close_if_ended(4)                             # unknown: nothing to do
