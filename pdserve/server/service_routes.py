"""Routes about the server rather than generation: health, models, info, load,
cache flush, metrics and aborts (SGLang's names, which its router calls).

/abort_request, /flush_cache and /drain are admin routes: http_front.KeyCheck lets through
only the --admin-api-key holder, or, without an admin key, loopback clients."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.config import ServerArgs
from pdserve.sampling_params import SamplingParams
from pdserve.server.http_common import error_body
from pdserve.server.protocol import ApiError
from pdserve.server.tokenizer_manager import TokenizerManager


async def json_body(request: Request) -> dict[str, Any]:
    """A body read by hand (routes without a schema), refused as FastAPI would refuse it."""
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # RecursionError: nesting too deep to decode
        raise ApiError("body: malformed JSON", "body") from None
    if not isinstance(body, dict):
        raise ApiError("body: must be a JSON object", "body")
    return body


class ServiceRoutes:
    def __init__(self, args: ServerArgs, manager: TokenizerManager, model_names: Sequence[str],
                 server_info: Callable[[], dict[str, Any]]) -> None:
        self.args = args
        self.manager = manager
        self.model_names = tuple(model_names)
        self.server_info = server_info
        self.admin_only = args.admin_key() is not None  # (read once: the key may come from a file)

    def register(self, app: FastAPI) -> None:
        app.get("/health")(self.health)
        app.get("/health_generate")(self.health_generate)
        app.get("/v1/models")(self.models)
        app.get("/get_model_info")(self.model_info)
        app.get("/model_info")(self.model_info)  # the newer SGLang spelling its router tries first
        app.get("/get_load")(self.get_load)
        app.get("/get_server_info")(self.get_server_info)
        app.get("/server_info")(self.get_server_info)
        app.post("/flush_cache")(self.flush_cache)
        app.get("/metrics")(self.metrics)
        app.post("/abort_request")(self.abort_request)
        app.post("/drain")(self.drain)

    async def health(self, request: Request) -> Response:
        if self.manager.drain is not None:
            # Who watches this server: a drain over waits for a router's next probe (drain.py).
            self.manager.drain.probed(request.client)
        if self.manager.dead_reason:
            return JSONResponse(error_body(self.manager.dead_reason, "server_error", None, 503), status_code=503)
        drain = self.manager.drain
        if drain is not None and drain.draining:
            # Out of rotation, not broken: a router reads "status" and sends elsewhere
            # without counting a failure; Kubernetes' readiness probe fails.
            body = {"status": "draining", **drain.status(),
                    **error_body("server is draining (shutting down)", "server_error", None, 503)}
            return JSONResponse(body, status_code=503)
        return Response(status_code=200)

    async def drain(self) -> JSONResponse:
        """Begin the drain SIGTERM begins (pdserve/server/drain.py): the process exits once
        in-flight requests end or --graceful-shutdown-timeout passes. Idempotent."""
        drain = self.manager.drain
        if drain is None:
            return JSONResponse(error_body("this server cannot drain", "server_error", None, 501), status_code=501)
        started = drain.start("POST /drain")
        return JSONResponse({"status": "draining", "started": started, **drain.status()})

    async def health_generate(self) -> Response:
        if self.args.disaggregation_mode != "null":
            # Half a server cannot generate alone; the scheduler's liveness is the signal.
            await self.manager.get_state()
            return Response(status_code=200)
        b = self.manager.builder
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        job = await self.manager.submit(b.build([b.tokenizer("ping")["input_ids"] or [0]], [params], False, 0))
        await self.manager.wait(job)
        return Response(status_code=200)

    async def models(self) -> dict[str, Any]:
        # Every served name, the one responses report first (a client taking data[0] gets it).
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pdserve",
                                            "max_model_len": self.manager.builder.context_len}
                                           for name in self.model_names]}

    async def model_info(self) -> dict[str, Any]:
        return {"model_path": self.args.model_path, "tokenizer_path": self.args.tokenizer_path,
                "served_model_name": self.model_names[0], "is_generation": True}

    async def get_load(self) -> list[dict[str, Any]]:
        """Load as SGLang reports it (its router's power_of_two policy reads it)."""
        st = await self.manager.get_state()
        return [{"dp_rank": 0, "num_reqs": st["num_running_reqs"] + st["num_waiting_reqs"],
                 "num_waiting_reqs": st["num_waiting_reqs"], "num_tokens": st["num_used_tokens"]}]

    async def get_server_info(self) -> dict[str, Any]:
        info = self.server_info()
        # SGLang's router (sgl-model-gateway) names a worker's model after the top-level
        # `served_model_name` string here, else `model_path`: the name requests must use,
        # not the checkpoint's directory (which a request naming it would get a 404 for).
        info["served_model_name"] = self.model_names[0]
        info["internal_state"] = await self.manager.get_state()
        # SGLang's top-level field (None without speculative decoding).
        info["avg_spec_accept_length"] = info["internal_state"].get("avg_spec_accept_length")
        if self.manager.drain is not None:
            info.update(self.manager.drain.status())  # "draining": whether a router should skip it
        return info

    async def flush_cache(self) -> Response:
        ok = await self.manager.flush_cache()
        return Response("Cache flushed.\n" if ok else "Cache not flushed: requests are running.\n",
                        status_code=200 if ok else 400)

    async def metrics(self) -> Response:
        if self.manager.dead_reason is None:
            self.manager.metrics.update_state(await self.manager.get_state())
        return Response(self.manager.metrics.render(), media_type="text/plain; version=0.0.4")

    async def abort_request(self, request: Request) -> Response:
        body = await json_body(request)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise ApiError("rid: must be a string", "rid")
        # With --admin-api-key set, KeyCheck let only its holder reach this route: only
        # then may an abort for a rid not seen yet wait for it (see TokenizerManager.abort).
        found = await self.manager.abort(rid, remember=self.admin_only)
        # SGLang answers 200 whether or not the request was still running.
        return JSONResponse({"rid": rid, "aborted": found})
