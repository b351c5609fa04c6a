"""The router's HTTP front: the servers' OpenAI and native routes in front of the
workers, plus health, aggregated server info, metrics, aborts and /tokenize + /detokenize
(passed to any healthy worker: each holds the tokenizer).

The router validates only what its own work depends on, before doing any (limits.py:
body size and nesting depth, `n`, `rid`, samples per request) and refuses the fields it
owns; the workers validate the rest, and their verdict (status and body) is passed
through unchanged.

Keys (as the servers check them, with the same middleware: http_front.KeyCheck):
`--api-key` is required on every route but /health (the admin key opens them too); the
admin routes (/abort_request, /flush_cache, and worker management under /workers) need
`--admin-api-key` when it is set (the API key is not enough: 401), and without it they
answer only loopback clients (403 to others). Whoever manages the workers decides where
every client's prompts and the router's keys go. The router sends the same keys to the
workers (the admin key on their admin routes), so the servers behind it should be started
with the same keys.

The router's state (workers, proxy, policies, discovery) is core.py's `Router`; this
module is its HTTP face: the routes, how each maps onto the router, and their errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pdserve.router.admin import spec_from_body
from pdserve.router.config import ConfigError, RouterConfig, normalise_url
from pdserve.router.core import INFO_TIMEOUT_S, Router
from pdserve.router.errors import error_body
from pdserve.router.limits import Refusal, check_generation, parse_json, read_body
from pdserve.router.legs import Reply
from pdserve.router.rooms import ROUTER_FIELDS, shape_of
from pdserve.router.streaming import StreamSession
from pdserve.router.workers import ROUTER_ID_HEADER, DuplicateWorker, RefusedWorker, Worker
from pdserve.server.http_front import KeyCheck

if TYPE_CHECKING:
    from pdserve.router.discovery import PodDiscovery

__all__ = ["ADMIN_PREFIXES", "ADMIN_ROUTES", "GENERATION_ROUTES", "Router", "create_app"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
ADMIN_ROUTES = ("/abort_request", "/flush_cache", "/workers")
ADMIN_PREFIXES = ("/workers/",)  # /workers/{url}: admin routes too


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    return JSONResponse(error_body(message, kind, param, status), status_code=status)


class _SessionResponse(StreamingResponse):
    """Streams a session and closes it however the response ends: the end of the
    stream, a client disconnect (Starlette cancels the streaming task), or shutdown."""

    def __init__(self, session: StreamSession) -> None:
        super().__init__(session.events(), media_type="text/event-stream")
        self.session = session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.session.close()


async def _until_disconnect(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run `work` unless the client goes away first (then cancel it: cancelling a request
    aborts its legs). Returns (completed, result)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        watcher.cancel()
    if task.cancelled():
        return False, None
    return True, task.result()

def create_app(cfg: RouterConfig, *, transport: httpx.AsyncBaseTransport | None = None,
               randbits: Callable[[int], int] = secrets.randbits,
               discovery: "PodDiscovery | None" = None) -> FastAPI:
    """`discovery`: the pod watcher to run (tests inject one fed with their own events);
    by default, with --service-discovery, one on the kubernetes client (ConfigError
    when the package is missing)."""
    if discovery is None and cfg.service_discovery:
        from pdserve.router.discovery import PodDiscovery
        discovery = PodDiscovery.from_config(cfg)
    router = Router(cfg, transport, randbits, discovery)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.router = router
    # Always: without any key the admin routes still answer loopback clients only.
    app.add_middleware(KeyCheck, api_key=cfg.api_key, admin_api_key=cfg.admin_api_key,
                       admin_paths=ADMIN_ROUTES, admin_prefixes=ADMIN_PREFIXES)
    metrics, proxy, registry = router.metrics, router.proxy, router.registry

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        # A router bug still answers in the API's error shape (and is logged with its traceback).
        logger.error("router error", exc_info=exc)
        return _error(f"router error: {type(exc).__name__}: {exc}", 500)

    async def json_object(request: Request) -> dict[str, Any]:
        """The body as a JSON object, read and parsed within the limits (else Refusal)."""
        body = parse_json(await read_body(request, cfg.max_request_bytes))
        if not isinstance(body, dict):
            raise Refusal("body: must be a JSON object", "body")
        return body

    # ---- generation -------------------------------------------------------------------
    def refused(route: str, exc: Refusal) -> Response:
        metrics.errors.labels("bad_request").inc()
        metrics.requests.labels(route, "client_error").inc()
        return _error(exc.message, exc.status, exc.param)

    async def generation(route: str, request: Request) -> Response:
        arrived = time.perf_counter()
        try:
            body = await json_object(request)
            if cfg.pd_disaggregation:
                for name in ROUTER_FIELDS:
                    if body.get(name) is not None:
                        raise Refusal(f"{name}: is set by the router (one room per sample); do not send it", name)
            check_generation(route, body, shape_of(route, body), max_n=cfg.max_n,
                             max_samples=cfg.max_request_samples)
        except Refusal as exc:
            return refused(route, exc)
        if body.get("stream") is True:
            completed, opened = await _until_disconnect(request, proxy.open_stream(route, body, arrived))
            if isinstance(opened, StreamSession):
                return _SessionResponse(opened)
        else:
            completed, opened = await _until_disconnect(request, proxy.unary(route, body))
        metrics.e2e.labels(route).observe(time.perf_counter() - arrived)
        if not completed or opened is None:
            metrics.errors.labels("client_disconnect").inc()
            metrics.requests.labels(route, "client_disconnect").inc()
            return Response(status_code=499)  # nobody is listening any more
        reply: Reply = opened  # type: ignore[assignment]
        outcome = "success" if reply.status < 400 else ("client_error" if reply.status < 500 else "server_error")
        metrics.requests.labels(route, outcome).inc()
        return Response(reply.content, status_code=reply.status, media_type=reply.media_type, headers=reply.headers)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await generation("/generate", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation("/v1/chat/completions", request)

    # ---- service routes ---------------------------------------------------------------
    @app.get("/health")
    @app.get("/readiness")  # (SGLang's router's name: the same answer)
    async def health() -> Response:
        """Ready: a healthy worker of every role (503 naming the missing roles otherwise),
        what a load balancer or a readiness probe asks."""
        missing = router.missing_roles()
        out = _error(f"no healthy {' and no healthy '.join(missing)} worker", 503) if missing \
            else Response(status_code=200)
        out.headers[ROUTER_ID_HEADER] = router.instance_id  # lets a probe of ours recognise us
        return out

    @app.get("/liveness")
    async def liveness() -> Response:
        """This process is alive and serving HTTP (SGLang's router's name), whatever its
        workers do: a liveness probe must not restart a router whose servers are still
        loading their weights (/health is 503 then)."""
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        return await _from_answering_worker("/v1/models")

    @app.get("/get_model_info")
    async def model_info() -> Response:
        return await _from_answering_worker("/get_model_info")

    async def _from_answering_worker(path: str, roles: tuple[str, ...] | None = None,
                                     body: bytes | None = None) -> Response:
        """A route every worker answers alike: the first healthy worker of `roles` (by
        default the decode role) that answers; with `body`, a POST of it as it came."""
        roles = roles or router.roles[-1:]
        for role in roles:
            for w in registry.healthy(role):
                try:
                    if body is None:
                        r = await w.client.get(w.url + path, headers=router.worker_headers, timeout=INFO_TIMEOUT_S)
                    else:
                        r = await w.client.post(w.url + path, content=body, timeout=INFO_TIMEOUT_S,
                                                headers={**router.worker_headers, "content-type": "application/json"})
                except (httpx.HTTPError, RuntimeError):  # RuntimeError: removed meanwhile
                    continue
                return Response(r.content, status_code=r.status_code,
                                media_type=r.headers.get("content-type", "application/json"))
        return _error(f"no healthy {' or '.join(roles)} worker answered {path}", 503)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _to_any_worker("/tokenize", request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _to_any_worker("/detokenize", request)

    async def _to_any_worker(path: str, request: Request) -> Response:
        """Every worker holds the tokenizer: a decode worker answers (in PD mode a prefill
        one when none does); the body goes as it came, within the body limit, and the
        worker's answer (its 400s included) comes back as it is."""
        try:
            body = await read_body(request, cfg.max_request_bytes)
        except Refusal as exc:
            return _error(exc.message, exc.status, exc.param)
        return await _from_answering_worker(path, tuple(reversed(router.roles)), body)

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        infos = await asyncio.gather(*(router.worker_info(w) for w in registry.workers))
        out: dict[str, Any] = {r: [i for i in infos if i["role"] == r] for r in router.roles}
        decodes = out[router.roles[-1]]
        accept = [d["avg_spec_accept_length"] for d in decodes if isinstance(d.get("avg_spec_accept_length"),
                                                                             (int, float))]
        # SGLang's bench reads this (PD: server_info["decode"][0]); the mean over decodes.
        out["avg_spec_accept_length"] = sum(accept) / len(accept) if accept else None
        out["router"] = {"mode": "pd" if cfg.pd_disaggregation else "plain", "healthy": not router.missing_roles(),
                         "prefill_policy": cfg.prefill_policy if cfg.pd_disaggregation else None,
                         "decode_policy": cfg.decode_policy if cfg.pd_disaggregation else cfg.policy,
                         "retries": cfg.retries, "health_check_interval": cfg.health_check_interval,
                         "in_flight_requests": len(proxy.active)}
        return out

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(registry.workers), media_type=CONTENT_TYPE_LATEST)

    # ---- admin routes (KeyCheck: the admin key when there is one, else loopback only) ----
    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        """Abort a request in flight by its rid (the client's own, else the router's),
        whoever sent it: only the admin may (KeyCheck)."""
        try:
            rid = (await json_object(request)).get("rid")
        except Refusal as exc:
            return _error(exc.message, exc.status, exc.param)
        if not isinstance(rid, str):
            return _error("rid: must be a string", 400, "rid")
        return JSONResponse({"rid": rid, "aborted": await proxy.abort_by_rid(rid)})

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        """Flush every healthy worker; 200 only if all of them flushed."""

        async def one(w: Worker) -> str | None:
            try:
                r = await w.client.post(w.url + "/flush_cache", headers=router.admin_headers,
                                        timeout=INFO_TIMEOUT_S)
                return None if r.status_code == 200 else f"{w.url}: {r.status_code} {r.text.strip()}"
            except (httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: removed meanwhile
                return f"{w.url}: {type(exc).__name__}"
        failed = [f for f in await asyncio.gather(*(one(w) for w in registry.workers if w.in_rotation)) if f]
        if failed:
            return _error("flush_cache: not flushed on " + "; ".join(failed), 400)
        return Response("Cache flushed.\n", status_code=200)

    # ---- worker management (admin.py) -------------------------------------------------
    def worker_url(raw: str) -> str | Response:
        """The {url} of /workers/{url} (percent-decoded by the server), normalised; or the
        refusal (a malformed url)."""
        try:
            return normalise_url(raw, "url")
        except ConfigError as exc:
            return _error(str(exc), 400, "url")

    @app.get("/workers")
    async def list_workers() -> Response:
        return JSONResponse({"workers": [w.status() for w in registry.workers]})

    @app.get("/workers/{url:path}")
    async def get_worker(url: str) -> Response:
        url_or_error = worker_url(url)
        if isinstance(url_or_error, Response):
            return url_or_error
        worker = registry.get(url_or_error)
        if worker is None:
            return _error(f"url: no worker {url_or_error}", 404, "url")
        return JSONResponse(worker.status())

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        try:
            spec = spec_from_body(await json_object(request), cfg.pd_disaggregation)
        except Refusal as exc:
            return _error(exc.message, exc.status, exc.param)
        try:
            worker = await router.add_worker(spec, "api")
        except DuplicateWorker as exc:
            return _error(f"url: {exc}", 409, "url")
        except RefusedWorker as exc:
            return _error(f"url: {exc}", 400, "url")
        except Exception as exc:  # nothing was left registered: answered here, not re-raised to the server
            return await _bug(request, exc)
        return JSONResponse(worker.status(), status_code=201)

    @app.delete("/workers/{url:path}")
    async def delete_worker(url: str) -> Response:
        url_or_error = worker_url(url)
        if isinstance(url_or_error, Response):
            return url_or_error
        worker = router.remove_worker(url_or_error)
        if worker is None:
            return _error(f"url: no worker {url_or_error}", 404, "url")
        # 202: the drain has started; GET /workers/{url} answers 404 once it is gone.
        return JSONResponse(worker.status(), status_code=202)

    return app
