"""A stand-in for a pdserve server (prefill, decode or colocated) that answers instantly
with deterministic tokens, for the router's tests and its throughput benchmark; and a
helper that serves any ASGI app from a thread on a port chosen at run time.

The fake speaks the servers' wire formats (the OpenAI routes, /generate, SSE ending
with [DONE], /health, /abort_request, /get_server_info) and checks what a real PD
server checks about the bootstrap fields, so the router cannot pass its tests by
sending something a real server would refuse. Faults are switched on per instance.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect


@dataclass
class Faults:
    healthy: bool = True
    draining: bool = False           # /health and new requests: 503 {"status": "draining"} (graceful drain)
    health_delay_s: float = 0.0      # /health answers this late (a hung worker)
    fail_status: int | None = None   # answer the next `fail_count` generation requests with this status
    fail_count: int = 0
    abort_next: int = 0              # end the next requests with a server-side abort (a failed transfer)
    delay_s: float = 0.0             # before the answer (or the first event)
    event_delay_s: float = 0.0       # between streamed events
    drop_after_events: int | None = None  # streams: close the connection after this many events
    hold: bool = False               # keep requests open until aborted (or released)
    shed_count: int = 0              # answer the next requests 503 + Retry-After (a full queue)
    gate: threading.Event | None = None  # hold each request (once received) until the test sets it
    retry_after: str = "2"


@dataclass
class FakeWorker:
    role: str = "decode"              # "prefill", "decode" or "plain"
    tokens: int = 4                   # tokens per sample when max_tokens allows
    faults: Faults = field(default_factory=Faults)
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    live: dict[str, asyncio.Event] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)   # rids answered in full
    shed: list[Any] = field(default_factory=list)        # rids refused with 503 + Retry-After
    # Keys as the servers check them (admin routes: the admin key when set; the others: the
    # API key, or the admin key)
    api_key: str | None = None
    admin_api_key: str | None = None
    auth: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Authorization) of each request

    def app(self) -> FastAPI:
        return build_app(self)


def _err(message: str, status: int, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def _samples(route: str, body: dict[str, Any]) -> tuple[int, int, bool]:
    """(prompts, n, batched) as the real servers read them."""
    if route == "/generate":
        value = body.get("text") if body.get("text") is not None else body.get("input_ids")
        batched = isinstance(value, list) and bool(value) and isinstance(value[0], (str, list))
        sp = body.get("sampling_params") or {}
        n = sp.get("n", 1) if isinstance(sp, dict) else 1
    else:
        value = body.get("prompt")
        batched = route == "/v1/completions" and isinstance(value, list) and bool(value) and \
            isinstance(value[0], (str, list))
        n = body.get("n", 1)
    return (len(value) if batched else 1), n, batched


def _max_tokens(route: str, body: dict[str, Any], default: int) -> int:
    if route == "/generate":
        sp = body.get("sampling_params") or {}
        return int(sp.get("max_new_tokens", default)) if isinstance(sp, dict) else default
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(value) if isinstance(value, int) else default


class _Keys:
    """Records each request's Authorization header and checks it as the servers do
    (pure ASGI: the routes still see client disconnects)."""

    def __init__(self, app: Any, worker: FakeWorker) -> None:
        self.app, self.w = app, worker

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        w, path = self.w, scope.get("path")
        if scope["type"] == "http" and path != "/health":
            got = dict(scope.get("headers") or ()).get(b"authorization")
            got = got.decode() if got is not None else None
            w.auth.append((path, got))
            if w.admin_api_key is not None and path in ("/abort_request", "/flush_cache"):
                keys = {w.admin_api_key}
            else:
                keys = {w.api_key, w.admin_api_key} if w.api_key is not None else set()
            if keys and got not in {f"Bearer {k}" for k in keys if k is not None}:
                await _err("invalid or missing API key", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(w: FakeWorker) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Keys, worker=w)

    @app.get("/health")
    async def health() -> Response:
        if w.faults.health_delay_s:
            await asyncio.sleep(w.faults.health_delay_s)
        if w.faults.draining:
            return JSONResponse({"status": "draining", "in_flight": len(w.live)}, status_code=503)
        return Response(status_code=200 if w.faults.healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": f"fake-{w.role}", "object": "model"}]}

    @app.get("/get_server_info")
    async def info() -> dict[str, Any]:
        return {"role": w.role, "avg_spec_accept_length": 2.5 if w.role == "decode" else None,
                "internal_state": {"num_running_reqs": len(w.live)}}

    @app.post("/flush_cache")
    async def flush() -> Response:
        return Response("Cache flushed.\n")

    @app.post("/abort_request")
    async def abort(request: Request) -> dict[str, Any]:
        rid = (await request.json())["rid"]
        w.aborts.append(rid)
        ev = w.live.get(rid)
        if ev is not None:
            ev.set()
        return {"rid": rid, "aborted": ev is not None}

    async def handle(route: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ClientDisconnect:  # the router cancelled this leg while it was being sent
            return Response(status_code=499)
        w.requests.append((route, body))
        prompts, n, batched = _samples(route, body)
        if w.role in ("prefill", "decode"):
            room = body.get("bootstrap_room")
            if room is None or body.get("bootstrap_host") is None:
                return _err(f"bootstrap_room: a {w.role} server needs bootstrap_host and bootstrap_room",
                            400, "bootstrap_room")
            total = prompts * n
            if isinstance(room, list):
                if len(room) != total or len(set(room)) != total:
                    return _err(f"bootstrap_room: {len(room)} values for {total} samples", 400, "bootstrap_room")
                if not batched and total == 1:
                    pass  # a list of one is accepted, as by the servers
            elif total > 1:
                return _err(f"bootstrap_room: {total} samples need one room each (a list)", 400, "bootstrap_room")
            rooms = room if isinstance(room, list) else [room]
            if not all(isinstance(r, int) and 0 <= r < 2**63 for r in rooms):
                return _err("bootstrap_room: must be in [0, 2^63)", 400, "bootstrap_room")
        if body.get("unknown_field") is not None:
            return _err("unknown_field: unsupported field", 400, "unknown_field")
        f = w.faults
        if f.draining:  # as the servers' graceful drain: new requests refused, naming it
            return JSONResponse({"status": "draining", "error": {
                "message": "the server is draining (shutting down): send the request elsewhere",
                "type": "server_error", "param": None, "code": 503}}, status_code=503)
        if f.shed_count > 0:  # as the servers' --max-queued-requests: refused before any work
            f.shed_count -= 1
            w.shed.append(body.get("rid"))
            resp = _err("the server's queue is full (--max-queued-requests); retry later", 503)
            resp.headers["retry-after"] = f.retry_after
            return resp
        if f.fail_count > 0 and f.fail_status is not None:
            f.fail_count -= 1
            return _err(f"injected failure on the {w.role} worker", f.fail_status)
        rid = body.get("rid")
        rids = rid if isinstance(rid, list) else [rid or f"auto-{time.monotonic_ns()}"]
        events = {r: asyncio.Event() for r in rids}
        w.live.update(events)
        aborted = False
        if f.abort_next > 0:
            f.abort_next -= 1
            aborted = True
        try:
            if f.hold or f.delay_s:
                # Wait (for the delay, or until aborted when holding); an abort ends the wait.
                waiters = [asyncio.ensure_future(e.wait()) for e in events.values()]
                done, pending = await asyncio.wait(waiters, timeout=None if f.hold else f.delay_s,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for p in pending:
                    p.cancel()
                aborted = aborted or bool(done)
        except asyncio.CancelledError:
            for r in rids:
                w.live.pop(r, None)
            raise
        while f.gate is not None and not f.gate.is_set():  # the test releases it (polled: another thread)
            await asyncio.sleep(0.01)
        count = 1 if w.role == "prefill" else max(1, min(w.tokens, _max_tokens(route, body, w.tokens)))
        if body.get("stream") is True:
            return StreamingResponse(stream(route, body, rids, prompts, n, count, aborted),
                                     media_type="text/event-stream")
        for r in rids:
            w.live.pop(r, None)
            if not aborted:
                w.finished.append(r)
        return JSONResponse(whole(route, body, rids, prompts, n, count, aborted))

    def token_text(i: int) -> str:
        return "abcdefghijklmnopqrstuvwxyz"[i % 26]

    def whole(route: str, body: dict[str, Any], rids: list[str], prompts: int, n: int, count: int,
              aborted: bool) -> Any:
        text = "".join(token_text(i) for i in range(count))
        if route == "/generate":
            fin = {"type": "abort", "message": "injected transfer failure"} if aborted else \
                {"type": "length", "length": count}
            out = [{"text": text, "output_ids": list(range(count)), "index": k,
                    "meta_info": {"id": rids[k // n] if k // n < len(rids) else rids[0], "prompt_tokens": 3,
                                  "completion_tokens": count, "finish_reason": fin}}
                   for k in range(prompts * n)]
            batched = _samples(route, body)[2]
            return out[0] if not batched and len(out) == 1 else out
        finish = "abort" if aborted else "length"
        if route == "/v1/completions":
            choices = [{"index": k, "text": text, "logprobs": None, "finish_reason": finish}
                       for k in range(prompts * n)]
            obj = "text_completion"
        else:
            choices = [{"index": k, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": finish} for k in range(n)]
            obj = "chat.completion"
        return {"id": f"x-{rids[0]}", "object": obj, "created": 0, "model": "fake", "choices": choices,
                "usage": {"prompt_tokens": 3, "completion_tokens": count * len(choices),
                          "total_tokens": 3 + count * len(choices)}}

    async def stream(route: str, body: dict[str, Any], rids: list[str], prompts: int, n: int, count: int,
                     aborted: bool) -> AsyncIterator[str]:
        f = w.faults
        sent = 0
        try:
            for i in range(count):
                last = i == count - 1
                for k in range(prompts * n):
                    if f.drop_after_events is not None and sent >= f.drop_after_events:
                        raise ConnectionResetError("injected: the worker died mid-stream")
                    if aborted:
                        fin_g: Any = {"type": "abort", "message": "injected transfer failure"}
                        fin_o: Any = "abort"
                    else:
                        fin_g = {"type": "length", "length": count} if last else None
                        fin_o = "length" if last else None
                    if route == "/generate":
                        ev: Any = {"text": "".join(token_text(j) for j in range(i + 1)), "output_ids": [i],
                                   "index": k, "meta_info": {"id": rids[0], "finish_reason": fin_g}}
                    elif route == "/v1/completions":
                        ev = {"id": "x", "object": "text_completion", "choices": [
                            {"index": k, "text": token_text(i), "logprobs": None, "finish_reason": fin_o}]}
                    else:
                        ev = {"id": "x", "object": "chat.completion.chunk", "choices": [
                            {"index": k, "delta": {"content": token_text(i)}, "logprobs": None,
                             "finish_reason": fin_o}]}
                    yield f"data: {json.dumps(ev)}\n\n"
                    sent += 1
                if aborted:
                    break
                if f.event_delay_s:
                    await asyncio.sleep(f.event_delay_s)
            yield "data: [DONE]\n\n"
            if not aborted:
                w.finished.extend(rids)
        finally:
            for r in rids:
                w.live.pop(r, None)

    for route in ("/generate", "/v1/completions", "/v1/chat/completions"):
        async def endpoint(request: Request, _route: str = route) -> Response:
            return await handle(_route, request)
        app.add_api_route(route, endpoint, methods=["POST"])
    return app


class ThreadedServer:
    """Serve an ASGI app with uvicorn on a thread, on a socket bound here (port 0: no
    race for a free port; `port` to come back on a known one). `with ThreadedServer(app) as s: s.url`."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when
        # the listening socket says TCP, and without it every response written in two
        # pieces (headers, body) waits ~40 ms for a delayed ACK.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", access_log=False, lifespan="on",
                                                    timeout_graceful_shutdown=0.25))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 20.0) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def __enter__(self) -> "ThreadedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
