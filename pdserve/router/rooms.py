"""What the router adds to a request body: one bootstrap room per sample, the prefill
server's address, and a router-chosen rid per prompt so that a leg can be aborted.

The shape of a request (how many prompts, how many samples each) is read from the
body leniently: a body the servers will refuse anyway gets some shape here and the
servers' 400 is what the client sees.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from typing import Any, Callable

ROOM_BITS = 63
# Fields the router owns: a client that sends them is refused (silently overwriting
# them would hide a client bug; passing them on would break the pairing).
ROUTER_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass(frozen=True)
class Shape:
    samples: tuple[int, ...]  # n of each prompt, in order
    batched: bool             # the body carries a list of prompts (even a list of one)

    @property
    def prompts(self) -> int:
        return len(self.samples)

    @property
    def total(self) -> int:
        return sum(self.samples)

    @property
    def scalar_room(self) -> bool:
        """A single prompt with a single sample gets a scalar room, anything else a list."""
        return not self.batched and self.total == 1


def _n(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def _is_batch_of_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], list)


def shape_of(route: str, body: dict[str, Any]) -> Shape:
    if route == "/generate":
        if "text" in body and body["text"] is not None:
            batched, count = isinstance(body["text"], list), len(body["text"]) if isinstance(body["text"], list) else 1
        else:
            ids = body.get("input_ids")
            batched = _is_batch_of_ids(ids)
            count = len(ids) if batched else 1
        sp = body.get("sampling_params")
        if isinstance(sp, list):
            ns = [_n(p.get("n", 1)) if isinstance(p, dict) else 1 for p in sp]
            samples = tuple(ns[i] if i < len(ns) else 1 for i in range(count))
        else:
            samples = (_n(sp.get("n", 1)) if isinstance(sp, dict) else 1,) * count
        return Shape(samples, batched)
    n = _n(body.get("n", 1))
    if route == "/v1/completions":
        prompt = body.get("prompt")
        batched = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        count = len(prompt) if batched else 1
        return Shape((n,) * max(count, 1), batched)
    return Shape((n,), False)  # chat: one conversation


def draw_rooms(shape: Shape, randbits: Callable[[int], int] = secrets.randbits) -> int | list[int]:
    """Fresh random 63-bit rooms, one per sample, prompt-major (prompt i's sample j at
    sum(n of prompts < i) + j, which is i * n + j when every prompt has the same n);
    distinct within the request."""
    rooms: list[int] = []
    seen: set[int] = set()
    while len(rooms) < shape.total:
        r = randbits(ROOM_BITS)
        if r not in seen:
            seen.add(r)
            rooms.append(r)
    return rooms[0] if shape.scalar_room else rooms


def leg_rids(route: str, shape: Shape, client_rid: Any, attempt: int) -> str | list[str] | None:
    """The rid(s) every leg of one attempt carries, so that a leg can be aborted with
    POST /abort_request. /generate takes one rid per prompt; the OpenAI routes take a
    single rid, so a batched /v1/completions gets none (the servers refuse a list
    there), and its legs can only be cancelled by closing their connections.

    A client's own rid is kept on the first attempt (it is the id the client knows)
    and suffixed on retries (the orphan leg of the failed attempt may still be live
    on a worker the retry reuses, and the servers refuse a live duplicate)."""
    suffix = f"-retry{attempt}" if attempt else ""
    if route != "/generate" and shape.batched:
        return client_rid  # forwarded as given: the servers refuse a rid on a batch with a 400
    if client_rid is None:
        fresh = [uuid.uuid4().hex for _ in range(shape.prompts)]
        return fresh if shape.batched else fresh[0]
    if isinstance(client_rid, list):
        return [f"{r}{suffix}" if isinstance(r, str) else r for r in client_rid]
    if isinstance(client_rid, str):
        return f"{client_rid}{suffix}"
    return client_rid  # not a string: the servers refuse it with a 400 naming rid


def rid_list(rids: str | list[str] | None) -> list[str]:
    if rids is None:
        return []
    return [rids] if isinstance(rids, str) else [r for r in rids if isinstance(r, str)]


def leg_body(body: dict[str, Any], *, rid: Any, host: str | None = None, port: int | None = None,
             rooms: int | list[int] | None = None) -> dict[str, Any]:
    """The body both legs get: the client's body, the rid(s), and in PD mode the
    bootstrap fields (host and port as scalars, the room scalar or one per sample)."""
    out = dict(body)
    if rid is not None:
        out["rid"] = rid
    if rooms is not None:
        out["bootstrap_host"] = host
        if port is not None:
            out["bootstrap_port"] = port
        out["bootstrap_room"] = rooms
    return out


def routing_key(route: str, body: dict[str, Any]) -> str | tuple | None:
    """What cache-aware routing matches on: the first prompt's text or token ids."""
    if route == "/v1/chat/completions":
        parts = []
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):
                    content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
                parts.append(f"{m.get('role')}:{content if isinstance(content, str) else ''}\n")
        return "".join(parts) or None
    value = body.get("prompt") if route == "/v1/completions" else (
        body.get("text") if body.get("text") is not None else body.get("input_ids"))
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value or None
    if isinstance(value, list) and value:
        return tuple(value)
    return None
