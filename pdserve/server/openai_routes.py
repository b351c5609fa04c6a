"""OpenAI's POST /v1/completions and /v1/chat/completions, streamed (SSE) or not.

A route checks the body and turns it into scheduler messages (`openai_requests`),
submits them and assembles the response from `results`. Streaming choices are built by small per-stream objects
(`CompletionChunks`, `ChatChunks`) that keep what a stream must remember.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from pdserve.config import ServerArgs
from pdserve.server.http_common import client_gone, client_rids, error_body, sse
from pdserve.server.messages import TextUpdate
from pdserve.server.openai_requests import (OpenAIRequest, chat_requests, check_chat_fields,
                                            check_completion_fields, completion_requests, template_call_args)
from pdserve.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, from_value_error
from pdserve.server.reasoning import ReasoningParser, parser_for
from pdserve.server.request_state import Job, RequestState
from pdserve.server.results import (TokenTexts, chat_logprobs, completion_logprobs, echo_logprobs, joined_logprobs,
                                    openai_finish, usage)
from pdserve.server.tool_calls import ToolOutput, finish_reason, tool_plan
from pdserve.server.tokenizer_manager import ServerUnavailable, TokenizerManager

# The finish message of a sample its client aborted; any other abort is the server's doing.
CLIENT_ABORT = "aborted by the client"
# The choices (one per SSE chunk, none: nothing to send) of one update.
Choice = Callable[[RequestState, TextUpdate], Union[dict[str, Any], list[dict[str, Any]], None]]


def raise_server_abort(job: Job) -> None:
    """A request the server had to give up on (not one the client aborted) is an error."""
    for st in job.states:
        for s in st.samples:
            if s.finish and s.finish.get("type") == "abort" and s.finish.get("message") != CLIENT_ABORT:
                if s.finish.get("server_error"):  # e.g. a failed KV transfer: retryable, not bad input
                    raise ApiError(str(s.finish.get("message")), None, status=503, kind="server_error")
                raise ApiError(str(s.finish.get("message")), None, status=400)


class CompletionChunks:
    """Choices of a streamed completion: the echo goes before a sample's first text, and
    logprob text offsets continue where the sample's previous chunk ended."""

    def __init__(self, job: Job, echo: dict[str, str], texts: TokenTexts | None, echo_logprobs: bool = False
                 ) -> None:
        self.job = job
        self.echo = echo      # rid -> the text to put first ("" without echo)
        self.texts = texts    # None: logprobs not asked for
        self.echo_logprobs = echo_logprobs  # the prompt's logprobs go with the echo
        self.text_pos: dict[tuple[str, int], int] = {}  # where a sample's next token starts

    def __call__(self, state: RequestState, update: TextUpdate) -> dict[str, Any] | None:
        s = state.samples[update.token.index]
        text = update.text_delta
        key = (state.rid, s.index)
        first = key not in self.text_pos
        if first:
            self.text_pos[key] = len(self.echo[state.rid])
            text = self.echo[state.rid] + text
        lp = None
        if self.texts is not None:
            lp = completion_logprobs(self.texts, update.token.new_ids, update.token.new_logprobs,
                                     update.token.new_top_logprobs, self.text_pos[key])
            self.text_pos[key] += sum(len(t) for t in lp["tokens"])
            if first and self.echo_logprobs:  # the sample's first update carries the prompt's
                lp = joined_logprobs(echo_logprobs(self.texts, state.prompt_ids, update.token.input_logprobs,
                                                   update.token.input_top_logprobs), lp)
        finish = openai_finish(update.token.finish)
        if not (text or finish or lp):
            return None
        return {"index": self.job.flat_index(state, s.index), "text": text, "logprobs": lp,
                "finish_reason": finish}


def chat_message(text: str, parser: ReasoningParser | None, tools: ToolOutput | None = None) -> dict[str, Any]:
    """The assistant message of a whole answer; with a reasoning parser its thinking goes
    to `reasoning_content` (null when there was none); with tool calling (`tools`, which
    reads the content after the reasoning) the calls go to `tool_calls` (left out when
    there were none) and `content` is the text outside them (null when empty)."""
    if parser is None:
        message: dict[str, Any] = {"role": "assistant", "content": text}
    else:
        reasoning, content = parser.parse(text)
        message = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
    if tools is not None:
        content, calls = tools.parse(message["content"])
        message["content"] = content or None
        if calls:
            message["tool_calls"] = calls
    return message


class ChatChunks:
    """Choices of a streamed chat completion: a sample's first delta carries the role.
    With a reasoning parser (`new_parser` makes one per sample), reasoning and content
    of one update go as two choices, the reasoning first; with tool calling (`new_tools`,
    one per sample, reading the content after the reasoning) a third carries the
    update's `tool_calls` deltas. The update's logprobs ride on the first, its finish
    reason on the last."""

    def __init__(self, texts: TokenTexts | None,
                 new_parser: Callable[[], ReasoningParser | None] = lambda: None,
                 new_tools: Callable[[], ToolOutput | None] = lambda: None) -> None:
        self.texts = texts    # None: logprobs not asked for
        self.new_parser = new_parser
        self.new_tools = new_tools
        self.parsers: dict[int, ReasoningParser | None] = {}  # sample index -> its parser
        self.tools: dict[int, ToolOutput | None] = {}         # sample index -> its tool-call reader

    def __call__(self, state: RequestState, update: TextUpdate) -> list[dict[str, Any]]:
        s = state.samples[update.token.index]
        first = s.index not in self.parsers
        if first:
            self.parsers[s.index] = self.new_parser()
            self.tools[s.index] = self.new_tools()
        parser, tools = self.parsers[s.index], self.tools[s.index]
        if parser is None:
            reasoning, content = "", update.text_delta
        else:
            reasoning, content = parser.feed(update.text_delta)
            if update.token.finish is not None:
                r, c = parser.flush()
                reasoning, content = reasoning + r, content + c
        calls: list[dict[str, Any]] = []
        if tools is not None:
            content, calls = tools.feed(content)
            if update.token.finish is not None:
                c, k = tools.flush()
                content, calls = content + c, calls + k
        finish = finish_reason(openai_finish(update.token.finish), tools)
        deltas = ([{"reasoning_content": reasoning}] if reasoning else []) + \
            ([{"content": content}] if content else []) + ([{"tool_calls": calls}] if calls else [])
        if first:  # the role goes with the first piece (an empty content when there is none yet)
            deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}, *deltas[1:]]
        lp = {"content": chat_logprobs(self.texts, update.token.new_ids, update.token.new_logprobs,
                                       update.token.new_top_logprobs)} if self.texts is not None else None
        if not deltas and (finish or lp):
            deltas.append({})
        choices = [{"index": s.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if choices:
            choices[0]["logprobs"] = lp
            choices[-1]["finish_reason"] = finish
        return choices


async def openai_events(manager: TokenizerManager, job: Job, head: dict[str, Any], include_usage: bool,
                        choice: Choice) -> AsyncIterator[str]:
    """SSE chunks of an OpenAI stream: one per update that carries something, a usage
    chunk if asked, an error event if the server failed, then [DONE]."""
    try:
        async for state, update in manager.stream(job):
            c = choice(state, update)
            for one in (c if isinstance(c, list) else [] if c is None else [c]):
                yield sse({**head, "choices": [one]})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(job.states)})
    except ServerUnavailable as exc:
        yield sse(error_body(str(exc), "server_error", None, 503))
    yield sse("[DONE]")


class OpenAIRoutes:
    def __init__(self, args: ServerArgs, manager: TokenizerManager, model_names: Sequence[str]) -> None:
        self.args = args
        self.manager = manager
        self.model_names = tuple(model_names)
        self.model_name = self.model_names[0]  # what responses report
        self.texts = TokenTexts(manager.tokenizer)
        self.template_args = template_call_args(manager.tokenizer)

    def register(self, app: FastAPI) -> None:
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)

    def _head(self, cid: str, obj: str) -> dict[str, Any]:
        return {"id": cid, "object": obj, "created": int(time.time()), "model": self.model_name}

    def _stream(self, job: Job, head: dict[str, Any], req: OpenAIRequest, choice: Choice) -> StreamingResponse:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(openai_events(self.manager, job, head, include_usage, choice),
                                 media_type="text/event-stream")

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        check_completion_fields(req, self.model_names)
        try:
            with self.manager.preparing_rids(client_rids(req.rid)):
                requests, texts = await self.manager.off_loop(completion_requests, self.args,
                                                              self.manager.builder, req)
                job = await self.manager.submit(requests)
        except ValueError as exc:
            raise from_value_error(exc) from None
        head = self._head(f"cmpl-{job.states[0].rid}", "text_completion")
        echo = {st.rid: (t if req.echo else "") for st, t in zip(job.states, texts)}
        token_texts = self.texts if req.logprobs is not None else None
        if req.stream:
            return self._stream(job, head, req, CompletionChunks(job, echo, token_texts, req.echo))
        await self.manager.wait(job, client_gone(request))
        raise_server_abort(job)
        choices = []
        for st in job.states:
            for s in st.samples:
                lp = completion_logprobs(token_texts, s.output_ids, s.logprobs, s.top_logprobs,
                                         len(echo[st.rid])) if token_texts is not None else None
                if lp is not None and req.echo:
                    lp = joined_logprobs(echo_logprobs(token_texts, st.prompt_ids, s.input_logprobs,
                                                       s.input_top_logprobs), lp)
                choices.append({"index": job.flat_index(st, s.index), "text": echo[st.rid] + s.text,
                                "logprobs": lp, "finish_reason": openai_finish(s.finish)})
        return JSONResponse({**head, "choices": choices, "usage": usage(job.states)})

    async def chat_completions(self, req: ChatCompletionRequest, request: Request) -> Response:
        check_chat_fields(req, self.model_names, self.template_args, self.args.allow_client_chat_template)
        try:
            plan = tool_plan([t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                             req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel)
                             else req.tool_choice, req.parallel_tool_calls, self.args.tool_call_parser)
            with self.manager.preparing_rids(client_rids(req.rid)):
                requests = await self.manager.off_loop(chat_requests, self.args, self.manager.builder, req, plan)
                job = await self.manager.submit(requests)
        except ValueError as exc:
            raise from_value_error(exc) from None
        head = self._head(f"chatcmpl-{job.states[0].rid}", "chat.completion")
        token_texts = self.texts if req.logprobs else None
        def new_parser() -> ReasoningParser | None:
            if plan is not None and plan.constrained:  # the output is the calls' JSON: no thinking
                return None
            return parser_for(self.args.reasoning_parser, req.separate_reasoning, req.chat_template_kwargs)
        def new_tools() -> ToolOutput | None:
            return plan.new_output() if plan is not None else None
        if req.stream:
            return self._stream(job, dict(head, object="chat.completion.chunk"), req,
                                ChatChunks(token_texts, new_parser, new_tools))
        await self.manager.wait(job, client_gone(request))
        raise_server_abort(job)
        choices = []
        for s in job.states[0].samples:
            tools = new_tools()
            choices.append({"index": s.index, "message": chat_message(s.text, new_parser(), tools),
                            "logprobs": {"content": chat_logprobs(token_texts, s.output_ids, s.logprobs,
                                                                  s.top_logprobs)}
                            if token_texts is not None else None,
                            "finish_reason": finish_reason(openai_finish(s.finish), tools)})
        return JSONResponse({**head, "choices": choices, "usage": usage(job.states)})
