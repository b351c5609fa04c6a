"""Bootstrap rooms (one 63-bit room per sample, prompt-major), rids, routing keys."""

from __future__ import annotations

import itertools

import pytest

from pdserve.router.rooms import Shape, draw_rooms, leg_body, leg_rids, routing_key, shape_of

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("route, body, samples, batched", [
    ("/v1/completions", {"prompt": "hi"}, (1,), False),
    ("/v1/completions", {"prompt": "hi", "n": 3}, (3,), False),
    ("/v1/completions", {"prompt": [1, 2, 3]}, (1,), False),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 2}, (2, 2), True),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, (1, 1), True),
    ("/v1/completions", {"prompt": ["only"]}, (1,), True),
    ("/v1/chat/completions", {"messages": [], "n": 4}, (4,), False),
    ("/generate", {"text": "x"}, (1,), False),
    ("/generate", {"text": "x", "sampling_params": {"n": 2}}, (2,), False),
    ("/generate", {"text": ["x", "y", "z"], "sampling_params": {"n": 2}}, (2, 2, 2), True),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 3}]}, (1, 3), True),
    ("/generate", {"input_ids": [1, 2, 3]}, (1,), False),
    ("/v1/completions", {"prompt": "x", "n": "three"}, (1,), False),  # the servers refuse it
])
def test_shape(route, body, samples, batched):
    assert shape_of(route, body) == Shape(samples, batched)


def test_rooms_scalar_for_one_sample_lists_otherwise():
    bits = iter([5, 6, 7, 8, 9, 10])
    assert draw_rooms(Shape((1,), False), lambda k: next(bits)) == 5
    assert draw_rooms(Shape((1,), True), lambda k: next(bits)) == [6]
    assert draw_rooms(Shape((2,), False), lambda k: next(bits)) == [7, 8]


def test_rooms_are_63_bit_distinct_and_prompt_major():
    rooms = draw_rooms(Shape((3, 3, 3), True))
    assert isinstance(rooms, list) and len(rooms) == 9 and len(set(rooms)) == 9
    assert all(0 <= r < 2**63 for r in rooms)
    assert max(rooms) >= 2**55  # drawn from the whole 63-bit range (fails with p ~ 2^-72)
    # Prompt i, sample j sits at i * n + j: with a counter, position == draw order.
    counter = itertools.count(100)
    assert draw_rooms(Shape((2, 2, 2), True), lambda k: next(counter)) == [100, 101, 102, 103, 104, 105]
    # A repeated draw is redrawn: rooms within a request never collide.
    dup = iter([1, 1, 2])
    assert draw_rooms(Shape((2,), False), lambda k: next(dup)) == [1, 2]


def test_leg_body_adds_fields_and_keeps_the_rest():
    body = {"prompt": "x", "n": 2, "temperature": 0}
    out = leg_body(body, rid="r1", host="10.0.0.1", port=8998, rooms=[1, 2])
    assert out == dict(body, rid="r1", bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=[1, 2])
    assert "rid" not in body  # the client's body is not modified
    assert "bootstrap_port" not in leg_body(body, rid=None, host="h", port=None, rooms=3)
    assert leg_body(body, rid="r") == dict(body, rid="r")  # plain mode


def test_leg_rids():
    single, batch = Shape((1,), False), Shape((1, 1), True)
    r = leg_rids("/v1/completions", single, None, 0)
    assert isinstance(r, str) and len(r) == 32
    gen = leg_rids("/generate", batch, None, 0)
    assert isinstance(gen, list) and len(gen) == 2 and len(set(gen)) == 2
    assert leg_rids("/v1/completions", batch, None, 0) is None  # the servers take no rid list there
    assert leg_rids("/v1/chat/completions", single, "mine", 0) == "mine"
    assert leg_rids("/v1/chat/completions", single, "mine", 1) == "mine-retry1"
    assert leg_rids("/generate", batch, ["a", "b"], 1) == ["a-retry1", "b-retry1"]


def test_routing_key():
    assert routing_key("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_key("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert routing_key("/generate", {"input_ids": [[1, 2], [3]]}) == (1, 2)
    assert routing_key("/generate", {"text": "t"}) == "t"
    key = routing_key("/v1/chat/completions", {"messages": [{"role": "system", "content": "S"},
                                                            {"role": "user", "content": "U"}]})
    assert key == "system:S\nuser:U\n"
    assert routing_key("/generate", {}) is None
