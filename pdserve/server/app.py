"""The FastAPI app of the HTTP process: error handlers, the key check and body limit of
`http_front`, and the routes of `service_routes` (health, info, metrics, aborts),
`openai_routes` (/v1/...), `native_routes` (/generate) and `tokenize_routes`
(/tokenize, /detokenize). Every error leaves as
OpenAI's error body."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.config import ServerArgs
from pdserve.server.http_common import error_body
from pdserve.server.drain import Refused
from pdserve.server.http_front import BodyLimit, KeyCheck
from pdserve.server.native_routes import NativeRoutes
from pdserve.server.openai_routes import OpenAIRoutes
from pdserve.server.protocol import ApiError
from pdserve.server.service_routes import ServiceRoutes
from pdserve.server.tokenize_routes import TokenizeRoutes
from pdserve.server.tokenizer_manager import ClientGone, ServerUnavailable, TokenizerManager


def create_app(args: ServerArgs, manager: TokenizerManager, model_names: Sequence[str],
               server_info: Callable[[], dict[str, Any]]) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    app.exception_handler(ApiError)(api_error)
    app.exception_handler(RequestValidationError)(validation_error)
    app.exception_handler(StarletteHTTPException)(http_error)
    app.exception_handler(ServerUnavailable)(unavailable)
    app.exception_handler(ClientGone)(client_gone)
    app.exception_handler(Refused)(refused)
    # The last added runs first: keys before the body is read, so that a client without
    # one cannot make the server buffer a body.
    app.add_middleware(BodyLimit, max_bytes=args.max_request_bytes)
    app.add_middleware(KeyCheck, api_key=args.api_key, admin_api_key=args.admin_key())
    ServiceRoutes(args, manager, model_names, server_info).register(app)
    NativeRoutes(args, manager).register(app)
    OpenAIRoutes(args, manager, model_names).register(app)
    TokenizeRoutes(args, manager, model_names).register(app)
    return app


# ---- errors ------------------------------------------------------------------------------
async def api_error(_: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code or exc.status),
                        status_code=exc.status)


async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A body the schema refused: 400 naming the first offending field."""
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    if err.get("type") == "extra_forbidden":
        message = f"{'.'.join(loc)}: unsupported field"
    elif err.get("type") == "json_invalid":
        message, param = "body: malformed JSON", "body"
    else:
        message = f"{'.'.join(loc) or 'body'}: {err.get('msg')}"
    return JSONResponse(error_body(message, "invalid_request_error", param, 400), status_code=400)


async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own errors (unknown route, wrong method, a body it cannot parse)
    in the OpenAI shape rather than {"detail": ...}."""
    message, param = str(exc.detail), None
    if exc.status_code == 400:
        # The only bare 400 here: a body FastAPI failed to read as JSON for a reason
        # other than bad syntax (invalid UTF-8, nesting too deep for the decoder).
        cause = f" ({exc.__cause__})" if exc.__cause__ else ""
        message, param = f"body: malformed JSON{cause}", "body"
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(error_body(message, kind, param, exc.status_code), status_code=exc.status_code,
                        headers=exc.headers)


async def unavailable(_: Request, exc: ServerUnavailable) -> JSONResponse:
    return JSONResponse(error_body(str(exc), "server_error", None, 503), status_code=503)


async def refused(_: Request, exc: Refused) -> JSONResponse:
    """Draining, or the queue is full (pdserve/server/drain.py): the client may retry, here
    after Retry-After seconds or at once on another server (nothing was generated)."""
    body = error_body(exc.message, "server_error", None, 503)
    if exc.status is not None:
        body = {"status": exc.status, **body}
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(exc.retry_after)})


async def client_gone(_: Request, exc: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it: the client closed the connection
