"""HTTP plumbing the route modules share: the error body, SSE framing, the client
disconnect watch, and the request fields every generation route carries."""

from __future__ import annotations

import json
from typing import Any, Sequence

from fastapi import Request

from pdserve.config import ServerArgs
from pdserve.requests import bootstrap_addresses
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.messages import Bootstrap
from pdserve.server.http_front import error_body

__all__ = ["error_body"]  # (defined with the HTTP front, which must stay light to import)

def client_rids(rid: Any) -> list[str]:
    """The rids a request body names (a string or a list; no rid: the server makes one)."""
    if isinstance(rid, str):
        return [rid]
    return [r for r in rid if isinstance(r, str)] if isinstance(rid, list) else []


def sse(data: Any) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def client_gone(request: Request) -> None:
    """Returns when the client of a request whose body was read disconnects (the
    ASGI server's next message for it is http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def bootstrap_of(args: ServerArgs, body: Any, params: Sequence[SamplingParams]
                 ) -> list[tuple[Bootstrap, ...]] | None:
    """The disaggregation fields of a request body (`bootstrap_host/port/room`), per
    prompt and sample; None on a colocated server. Raises ValueError naming the field."""
    return bootstrap_addresses(args.disaggregation_mode, args.disaggregation_bootstrap_port,
                               body.bootstrap_host, body.bootstrap_port, body.bootstrap_room,
                               [p.n for p in params])
