"""What the router checks before it does any work for a request: the body's size (read
no further than the limit), its JSON nesting depth, and the fields whose size the
router's own work depends on: `n` and the number of samples (one bootstrap room each)
and `rid` (the abort handle). Each check costs at most one pass over the body; every
refusal is a `Refusal` naming the field (the app answers it in OpenAI's error shape).

Everything else is the workers' to validate: their verdict passes through.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from starlette.requests import Request

from pdserve.router.rooms import Shape

MAX_JSON_DEPTH = 64
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string (linear on valid JSON)
PROMPT_FIELD = {"/generate": "text", "/v1/completions": "prompt", "/v1/chat/completions": "messages"}


class Refusal(Exception):
    """A request the router answers itself with a 4xx naming `param`."""

    def __init__(self, message: str, param: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit` bytes: from its
    Content-Length before reading anything, else while it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise Refusal("body: the Content-Length header is not a number", "body") from None
        if size > limit:
            raise _too_large(size, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit, at_least=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int, at_least: bool = False) -> Refusal:
    what = f"more than {limit}" if at_least else str(size)  # (the servers' words)
    return Refusal(f"body: {what} bytes exceed the limit of {limit} bytes (--max-request-bytes)", "body", 413)


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads, refusing malformed bodies and bodies nested deeper than `max_depth`
    (the C parser's RecursionError is caught; the depth check is a vectorised pass)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError:
        raise Refusal("body: malformed JSON", "body") from None
    if json_depth(raw, max_depth) > max_depth:
        raise _too_deep(max_depth)
    return value


def _too_deep(max_depth: int) -> Refusal:
    return Refusal(f"body: JSON nested deeper than {max_depth} levels", "body")


def json_depth(raw: bytes, cap: int) -> int:
    """The nesting depth of valid JSON `raw`, exactly when it is above `cap` (else some
    value <= cap): brackets outside strings, counted with numpy."""
    if raw.count(b"[") + raw.count(b"{") <= cap:  # the usual body: nothing to count
        return 0
    encoding = json.detect_encoding(raw)
    if encoding not in ("utf-8", "utf-8-sig"):  # UTF-16/32 (RFC 8259 allows them in practice)
        raw = raw.decode(encoding).encode("utf-8", "surrogatepass")
    outside = np.frombuffer(_STRING.sub(b"", raw), np.uint8)
    opens = (outside == ord("[")) | (outside == ord("{"))
    closes = (outside == ord("]")) | (outside == ord("}"))
    return int(np.cumsum(opens.astype(np.int32) - closes, dtype=np.int32).max(initial=0))


# ---- the fields the router's own work depends on ------------------------------------------
def check_generation(route: str, body: dict[str, Any], shape: Shape, *, max_n: int, max_samples: int) -> None:
    """n, rid and the sample count of a generation body, before rooms are drawn or
    the body copied per leg. Raises Refusal naming the field."""
    for n in _ns(route, body):
        _check_n(n, max_n)
    _check_rid(route, body.get("rid"), shape)
    if shape.total > max_samples:
        raise Refusal(f"{PROMPT_FIELD[route]}: {shape.total} samples (prompts x n) is above the limit "
                      f"{max_samples} (--max-request-samples)", PROMPT_FIELD[route])


def _ns(route: str, body: dict[str, Any]) -> list[Any]:
    if route != "/generate":
        return [body.get("n")]
    sp = body.get("sampling_params")
    if isinstance(sp, dict):
        return [sp.get("n")]
    if isinstance(sp, list):  # one per prompt
        return [p.get("n") for p in sp if isinstance(p, dict)]
    return []  # not a dict: the workers refuse it


def _check_n(n: Any, max_n: int) -> None:
    if n is None:  # unset, or null: the default, 1
        return
    if not isinstance(n, int) or isinstance(n, bool):
        raise Refusal(f"n: must be an integer, got {type(n).__name__}", "n")
    if n < 1:
        raise Refusal(f"n: must be >= 1, got {n}", "n")
    if n > max_n:
        raise Refusal(f"n: {n} is above the limit {max_n} (--max-n)", "n")


def _check_rid(route: str, rid: Any, shape: Shape) -> None:
    """A string, or (where several prompts can come in one body) a list of distinct
    strings, one per prompt. Chat takes a single string."""
    if rid is None:
        return
    lists = route != "/v1/chat/completions"
    what = "a string or a list of strings (one per prompt)" if lists else "a string"
    if isinstance(rid, str):
        rids = [rid]
    elif lists and isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        rids = rid
    else:
        raise Refusal(f"rid: must be {what}", "rid")
    if len(rids) != shape.prompts:
        raise Refusal(f"rid: {len(rids)} given for {shape.prompts} prompt(s); one per prompt is required", "rid")
    if len(set(rids)) != len(rids):
        raise Refusal("rid: one distinct rid per prompt is required", "rid")
