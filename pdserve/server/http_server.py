"""FastAPI app: OpenAI routes, SGLang's native routes, health, metrics, auth."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.config import ServerArgs
from pdserve.requests import check_text
from pdserve.sampling_params import SamplingParams
from pdserve.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, GenerateRequest,
                                     from_value_error, refuse_unsupported)
from pdserve.server.tokenizer_manager import (ClientGone, Job, RequestState, SampleResult, ServerUnavailable,
                                              TokenizerManager)

CLIENT_ABORT = "aborted by the client"


def error_body(message: str, kind: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(data: Any) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def create_app(args: ServerArgs, manager: TokenizerManager, model_name: str,
               server_info: Callable[[], dict[str, Any]]) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    tokenizer = manager.tokenizer
    context_len = manager.builder.context_len

    # ---- errors and auth ------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.status), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
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

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
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

    @app.exception_handler(ServerUnavailable)
    async def _unavailable(_: Request, exc: ServerUnavailable) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "server_error", None, 503), status_code=503)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client closed the connection

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        if args.api_key and request.url.path != "/health":
            if request.headers.get("authorization") != f"Bearer {args.api_key}":
                return JSONResponse(error_body("invalid or missing API key", "authentication_error", None, 401),
                                    status_code=401)
        return await call_next(request)

    # ---- service routes -----------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if manager.dead_reason:
            return JSONResponse(error_body(manager.dead_reason, "server_error", None, 503), status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if args.disaggregation_mode != "null":
            # Half a server cannot generate alone; the scheduler's liveness is the signal.
            await manager.get_state()
            return Response(status_code=200)
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        job = await manager.submit([tokenizer("ping")["input_ids"] or [0]], [params], False, 0)
        await manager.wait(job)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": context_len}]}

    @app.get("/get_model_info")
    @app.get("/model_info")  # the newer SGLang spelling its router tries first
    async def model_info() -> dict[str, Any]:
        return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path, "is_generation": True}

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        """Load as SGLang reports it (its router's power_of_two policy reads it)."""
        st = await manager.get_state()
        return [{"dp_rank": 0, "num_reqs": st["num_running_reqs"] + st["num_waiting_reqs"],
                 "num_waiting_reqs": st["num_waiting_reqs"], "num_tokens": st["num_used_tokens"]}]

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> dict[str, Any]:
        info = server_info()
        info["internal_state"] = await manager.get_state()
        # SGLang's top-level field (None without speculative decoding).
        info["avg_spec_accept_length"] = info["internal_state"].get("avg_spec_accept_length")
        return info

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        ok = await manager.flush_cache()
        return Response("Cache flushed.\n" if ok else "Cache not flushed: requests are running.\n",
                        status_code=200 if ok else 400)

    @app.get("/metrics")
    async def metrics() -> Response:
        if manager.dead_reason is None:
            manager.metrics.update_state(await manager.get_state())
        return Response(manager.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json_body(request)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise ApiError("rid: must be a string", "rid")
        found = await manager.abort(rid)
        # SGLang answers 200 whether or not the request was still running.
        return JSONResponse({"rid": rid, "aborted": found})

    # ---- disaggregation fields ---------------------------------------------------------
    def bootstrap_of(req: Any, params: list[Any]) -> list[list[tuple[str, int, int]]] | None:
        """Per prompt, per sample (host, port, room) of its prefill server; None when
        colocated. Lists carry one value per sample, prompt-major (prompt i's sample j
        at sum(n of prompts < i) + j), as SGLang's router sends them; scalars apply to
        all samples (a room only when there is a single sample)."""
        given = [req.bootstrap_host, req.bootstrap_port, req.bootstrap_room]
        if args.disaggregation_mode == "null":
            return None  # a colocated server ignores them, as SGLang's does
        if req.bootstrap_room is None or req.bootstrap_host is None:
            raise ApiError(f"bootstrap_room: a {args.disaggregation_mode} server needs bootstrap_host and "
                           "bootstrap_room (send requests through a PD router)", "bootstrap_room")
        counts = [p.n for p in params]
        total = sum(counts)

        def per_sample(value: Any, name: str) -> list[Any]:
            if not isinstance(value, list):
                return [value] * total
            if len(value) == total:
                return value
            raise ApiError(f"{name}: {len(value)} values for {total} samples ({len(counts)} prompts x n); "
                           "give one per sample", name)
        hosts, ports, rooms = (per_sample(v, n) for v, n in zip(
            given, ("bootstrap_host", "bootstrap_port", "bootstrap_room")))
        if total > 1 and not isinstance(req.bootstrap_room, list):
            raise ApiError(f"bootstrap_room: {total} samples need one room each (a list)", "bootstrap_room")
        if len(set(rooms)) != len(rooms):
            raise ApiError("bootstrap_room: every sample needs a distinct room", "bootstrap_room")
        flat = []
        for h, p, r in zip(hosts, ports, rooms):
            if not isinstance(r, int) or not 0 <= r < 2**63:
                raise ApiError(f"bootstrap_room: must be in [0, 2^63), got {r}", "bootstrap_room")
            port = p if p is not None else args.disaggregation_bootstrap_port
            if not 0 < port <= 65535:
                raise ApiError(f"bootstrap_port: must be in [1, 65535], got {port}", "bootstrap_port")
            flat.append((h, port, r))
        out, at = [], 0
        for c in counts:
            out.append(flat[at: at + c])
            at += c
        return out

    async def client_gone(request: Request) -> None:
        """Returns when the client of a request whose body was read disconnects (the
        ASGI server's next message for it is http.disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    # ---- native /generate -----------------------------------------------------------
    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Response:
        refuse_unsupported(req)
        if req.logprob_start_len is not None and req.logprob_start_len != -1:
            raise ApiError("logprob_start_len: prompt logprobs are not supported (only -1: output logprobs)",
                           "logprob_start_len")
        b = manager.builder
        try:
            prompts, single = b.token_ids(req.text, req.input_ids, "text", "input_ids")
            params = b.sampling_params(req.sampling_params, len(prompts))
            rids = None
            if req.rid is not None:
                rids = [req.rid] if isinstance(req.rid, str) else list(req.rid)
            job = await manager.submit(prompts, params, req.return_logprob, req.top_logprobs_num, rids,
                                       bootstrap_of(req, params))
        except ValueError as exc:
            raise from_value_error(exc) from None
        if req.stream:
            return StreamingResponse(_generate_stream(job), media_type="text/event-stream")
        await manager.wait(job, client_gone(request))
        results = [_native_result(st, s) for st in job.states for s in st.samples]
        return JSONResponse(results[0] if single and len(results) == 1 else results)

    async def _generate_stream(job: Job) -> AsyncIterator[str]:
        try:
            async for state, update in manager.stream(job):
                if update.text_delta or update.token.new_ids or update.token.finish:
                    # `index` tells the samples of a batch or of n > 1 apart (as in SGLang).
                    index = job.flat_index(state, update.token.index)
                    yield sse(dict(_native_result(state, state.samples[update.token.index]), index=index))
        except ServerUnavailable as exc:
            yield sse(error_body(str(exc), "server_error", None, 503))
        yield sse("[DONE]")

    def _native_result(state: RequestState, s: SampleResult) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": state.rid, "prompt_tokens": len(state.prompt_ids), "completion_tokens": len(s.output_ids),
            "cached_tokens": s.cached_tokens, "finish_reason": s.finish, "retractions": s.retractions,
        }
        if s.spec_verify_ct:
            meta["spec_verify_ct"] = s.spec_verify_ct
            meta["spec_accepted_drafts"] = s.spec_accepted_drafts
        if s.logprobs:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(s.logprobs, s.output_ids)]
        if s.top_logprobs:
            meta["output_top_logprobs"] = [[(lp, t, None) for lp, t in step] for step in s.top_logprobs]
        if s.finish and s.finish.get("type") == "length":
            meta["finish_reason"] = dict(s.finish, length=len(s.output_ids))
        return {"text": s.text, "output_ids": list(s.output_ids), "meta_info": meta}

    # ---- OpenAI ----------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(f"model: {name!r} is not served here (serving {model_name!r})", "model")

    def openai_stream(job: Job, obj: str, cid: str, created: int, options: Any,
                      choice: Callable[[RequestState, Any], dict[str, Any] | None]) -> StreamingResponse:
        """SSE chunks of an OpenAI stream: one per update that carries something,
        a usage chunk if asked, an error event if the server failed, then [DONE]."""
        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return sse({"id": cid, "object": obj, "created": created, "model": model_name,
                        "choices": choices, **extra})

        async def events() -> AsyncIterator[str]:
            try:
                async for state, update in manager.stream(job):
                    c = choice(state, update)
                    if c is not None:
                        yield chunk([c])
                if options and options.include_usage:
                    yield chunk([], usage=_usage(job))
            except ServerUnavailable as exc:
                yield sse(error_body(str(exc), "server_error", None, 503))
            yield sse("[DONE]")
        return StreamingResponse(events(), media_type="text/event-stream")

    def sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: bool,
                 max_field: str) -> SamplingParams:
        try:
            return SamplingParams(
                max_new_tokens=max_tokens, min_new_tokens=req.min_tokens, temperature=req.temperature,
                top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                stop=tuple([req.stop] if isinstance(req.stop, str) else (req.stop or [])),
                stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, n=req.n,
                seed=req.seed, skip_special_tokens=req.skip_special_tokens, no_stop_trim=req.no_stop_trim)
        except ValueError as exc:
            text = str(exc).replace("max_new_tokens", max_field).replace("min_new_tokens", "min_tokens")
            raise from_value_error(ValueError(text)) from None

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        refuse_unsupported(req)
        check_model(req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError("best_of: only best_of == n is supported", "best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise ApiError("logprobs: must be in [0, 20]", "logprobs")
        if req.echo and req.logprobs is not None:
            raise ApiError("echo: echo with logprobs (prompt logprobs) is not supported", "echo")
        b = manager.builder
        try:
            if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], str)):
                prompts, _ = b.token_ids(req.prompt, None, "prompt", "prompt")
                texts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
            else:
                prompts, _ = b.token_ids(None, req.prompt or None, "prompt", "prompt")
                texts = [tokenizer.decode(p) for p in prompts]
        except ValueError as exc:
            raise from_value_error(exc) from None
        params = [sampling(req, req.max_tokens if req.max_tokens is not None else context_len - len(p),
                           req.logprobs is not None, "max_tokens") for p in prompts]
        top = req.logprobs or 0
        try:
            job = await manager.submit(prompts, params, req.logprobs is not None, top,
                                       [req.rid] if isinstance(req.rid, str) else req.rid, bootstrap_of(req, params))
        except ValueError as exc:
            raise from_value_error(ValueError(str(exc).replace("max_new_tokens", "max_tokens"))) from None
        cid = f"cmpl-{job.states[0].rid}"
        created = int(time.time())
        echo = {st.rid: (t if req.echo else "") for st, t in zip(job.states, texts)}

        if req.stream:
            # Per sample: where the next token starts in the choice's text (after the echo).
            text_pos: dict[tuple[str, int], int] = {}

            def choice(state: RequestState, update: Any) -> dict[str, Any] | None:
                s = state.samples[update.token.index]
                text = update.text_delta
                key = (state.rid, s.index)
                if key not in text_pos:
                    text_pos[key] = len(echo[state.rid])
                    text = echo[state.rid] + text
                lp = None
                if req.logprobs is not None:
                    lp = _completion_logprobs(update.token.new_ids, update.token.new_logprobs,
                                              update.token.new_top_logprobs, text_pos[key])
                    text_pos[key] += sum(len(t) for t in lp["tokens"])
                finish = _openai_finish(update.token.finish)
                if not (text or finish or lp):
                    return None
                return {"index": job.flat_index(state, s.index), "text": text, "logprobs": lp,
                        "finish_reason": finish}
            return openai_stream(job, "text_completion", cid, created, req.stream_options, choice)
        await manager.wait(job, client_gone(request))
        _raise_server_abort(job)
        choices = []
        for st in job.states:
            for s in st.samples:
                lp = _completion_logprobs(s.output_ids, s.logprobs, s.top_logprobs, len(echo[st.rid])) \
                    if req.logprobs is not None else None
                choices.append({"index": job.flat_index(st, s.index), "text": echo[st.rid] + s.text,
                                "logprobs": lp, "finish_reason": _openai_finish(s.finish)})
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                             "choices": choices, "usage": _usage(job)})

    def chat_prompt(req: ChatCompletionRequest) -> str:
        """The conversation rendered by the chat template. Raises ValueError naming the field."""
        messages = []
        for i, m in enumerate(req.messages):
            if isinstance(m.content, list):
                if any(part.type != "text" for part in m.content):
                    raise ValueError("messages: only text content parts are supported")
                content = "".join(part.text or "" for part in m.content)
            else:
                content = m.content or ""
            check_text(content, f"messages[{i}].content")
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        try:
            prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                        **(req.chat_template_kwargs or {}))
        except Exception as exc:  # a template that rejects the conversation
            raise ValueError(f"messages: the chat template failed: {exc}") from None
        # The contents are checked above, so invalid text here came from the template's kwargs.
        check_text(prompt_text, "chat_template_kwargs")
        return prompt_text

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        refuse_unsupported(req)
        check_model(req.model)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise ApiError("top_logprobs: must be in [0, 20]", "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise ApiError("top_logprobs: requires logprobs to be true", "top_logprobs")
        try:
            prompt_text = chat_prompt(req)
        except ValueError as exc:
            raise from_value_error(exc) from None
        ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ApiError("messages: the conversation is empty", "messages")
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling(req, max_tokens if max_tokens is not None else max(1, context_len - len(ids)),
                          req.logprobs, max_field)
        top = req.top_logprobs or 0
        try:
            job = await manager.submit([ids], [params], req.logprobs, top, [req.rid] if req.rid else None,
                                       bootstrap_of(req, [params]))
        except ValueError as exc:
            raise from_value_error(ValueError(str(exc).replace("max_new_tokens", max_field))) from None
        cid = f"chatcmpl-{job.states[0].rid}"
        created = int(time.time())
        if req.stream:
            started_chat: set[int] = set()

            def chat_choice(state: RequestState, update: Any) -> dict[str, Any] | None:
                s = state.samples[update.token.index]
                delta: dict[str, Any] = {}
                if s.index not in started_chat:
                    started_chat.add(s.index)
                    delta["role"] = "assistant"
                if update.text_delta or "role" in delta:
                    delta["content"] = update.text_delta
                lp = {"content": _chat_logprobs(update.token.new_ids, update.token.new_logprobs,
                                                update.token.new_top_logprobs)} if req.logprobs else None
                finish = _openai_finish(update.token.finish)
                if not (delta or finish or lp):
                    return None
                return {"index": s.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return openai_stream(job, "chat.completion.chunk", cid, created, req.stream_options, chat_choice)
        await manager.wait(job, client_gone(request))
        _raise_server_abort(job)
        st = job.states[0]
        choices = [{"index": s.index, "message": {"role": "assistant", "content": s.text},
                    "logprobs": {"content": _chat_logprobs(s.output_ids, s.logprobs, s.top_logprobs)}
                    if req.logprobs else None,
                    "finish_reason": _openai_finish(s.finish)} for s in st.samples]
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                             "choices": choices, "usage": _usage(job)})

    # ---- response helpers ---------------------------------------------------------
    token_text_cache: dict[int, str] = {}

    def token_text(t: int) -> str:
        text = token_text_cache.get(t)
        if text is None:
            text = token_text_cache[t] = tokenizer.decode([t])
        return text

    def _completion_logprobs(ids: Any, lps: Any, tops: Any, offset: int) -> dict[str, Any]:
        """OpenAI's completions logprobs; `offset` is where the first token starts in the
        choice's text, each next token starts where the previous one's text ends."""
        tokens = [token_text(t) for t in ids]
        return {"tokens": tokens, "token_logprobs": list(lps),
                "top_logprobs": [{token_text(t): lp for lp, t in step} for step in tops] if tops
                else [None] * len(ids),
                "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))
                if tokens else []}

    def _chat_logprobs(ids: Any, lps: Any, tops: Any) -> list[dict[str, Any]]:
        out = []
        for i, (t, lp) in enumerate(zip(ids, lps)):
            tok = token_text(t)
            top = [{"token": token_text(tt), "logprob": tlp, "bytes": list(token_text(tt).encode())}
                   for tlp, tt in (tops[i] if tops else ())]
            out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": top})
        return out

    return app


def _openai_finish(finish: dict[str, Any] | None) -> str | None:
    if finish is None:
        return None
    return {"stop": "stop", "length": "length"}.get(finish.get("type", ""), "abort")


def _usage(job: Job) -> dict[str, Any]:
    prompt = sum(len(st.prompt_ids) for st in job.states)
    completion = sum(len(s.output_ids) for st in job.states for s in st.samples)
    cached = sum(st.samples[0].cached_tokens for st in job.states)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _raise_server_abort(job: Job) -> None:
    """A request the server had to give up on (not one the client aborted) is an error."""
    for st in job.states:
        for s in st.samples:
            if s.finish and s.finish.get("type") == "abort" and s.finish.get("message") != CLIENT_ABORT:
                if s.finish.get("server_error"):  # e.g. a failed KV transfer: retryable, not bad input
                    raise ApiError(str(s.finish.get("message")), None, status=503, kind="server_error")
                raise ApiError(str(s.finish.get("message")), None, status=400)


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # RecursionError: nesting too deep to decode
        raise ApiError("body: malformed JSON", "body") from None
    if not isinstance(body, dict):
        raise ApiError("body: must be a JSON object", "body")
    return body


def server_args_dict(args: ServerArgs) -> dict[str, Any]:
    d = dataclasses.asdict(args)
    if d.get("api_key"):
        d["api_key"] = "***"
    return d


def new_rid() -> str:
    return uuid.uuid4().hex
