"""Errors the router itself answers with, in the servers' (OpenAI's) shape."""

from __future__ import annotations

import json
from typing import Any


def error_body(message: str, kind: str = "server_error", param: str | None = None,
               code: int = 500) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_bytes(message: str, status: int, param: str | None = None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps(error_body(message, kind, param, status)).encode()


def sse_event(data: Any) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
