"""OpenAI's POST /v1/completions and /v1/chat/completions, streamed (SSE) or not.

A route checks what only its API defines, turns the body into scheduler
messages through the shared RequestBuilder (errors name the OpenAI fields:
`max_tokens`, `min_tokens`), submits them and assembles the response from
`results`. Streaming choices are built by small per-stream objects
(`CompletionChunks`, `ChatChunks`) that keep what a stream must remember.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from typing import Any, AsyncIterator, Callable, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from pdserve.config import ServerArgs
from pdserve.requests import ApiFields, RequestBuilder, check_new_tokens, check_text
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.grammar import check_constraint
from pdserve.scheduler.messages import NewRequest
from pdserve.server.http_common import bootstrap_of, client_gone, client_rids, error_body, sse
from pdserve.server.messages import TextUpdate
from pdserve.server.protocol import (ApiError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                     from_value_error, refuse_unsupported)
from pdserve.server.reasoning import ReasoningParser, parser_for
from pdserve.server.results import (TokenTexts, chat_logprobs, completion_logprobs, echo_logprobs, joined_logprobs,
                                    openai_finish, usage)
from pdserve.server.tool_calls import ToolOutput, ToolPlan, finish_reason, tool_plan
from pdserve.server.tokenizer_manager import Job, RequestState, ServerUnavailable, TokenizerManager

# The finish message of a sample its client aborted; any other abort is the server's doing.
CLIENT_ABORT = "aborted by the client"
COMPLETION_FIELDS = ApiFields(max_new_tokens="max_tokens", min_new_tokens="min_tokens")

OpenAIRequest = Union[CompletionRequest, ChatCompletionRequest]
# The choices (one per SSE chunk, none: nothing to send) of one update.
Choice = Callable[[RequestState, TextUpdate], Union[dict[str, Any], list[dict[str, Any]], None]]


# ---- from a body to scheduler messages ---------------------------------------------------
# The name SGLang's documentation and examples send: whatever this server serves.
DEFAULT_MODEL_NAME = "default"


def check_model(name: str | None, served: Sequence[str]) -> None:
    """A request may name the model by any served name or as "default" (or not at all);
    another name is OpenAI's 404 `model_not_found`, as vLLM answers it."""
    if name is not None and name != DEFAULT_MODEL_NAME and name not in served:
        raise ApiError(f"The model {name!r} does not exist (this server serves "
                       f"{', '.join(repr(s) for s in served)}, also as {DEFAULT_MODEL_NAME!r})",
                       "model", status=404, code="model_not_found")


def check_completion_fields(req: CompletionRequest, served: Sequence[str]) -> None:
    refuse_unsupported(req)
    check_model(req.model, served)
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError("best_of: only best_of == n is supported", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise ApiError("logprobs: must be in [0, 20]", "logprobs")


def check_chat_fields(req: ChatCompletionRequest, served: Sequence[str], template_args: frozenset[str],
                      allow_client_template: bool) -> None:
    refuse_unsupported(req)
    check_model(req.model, served)
    if req.stream_reasoning is False:
        raise ApiError("stream_reasoning: false (the reasoning held back and sent in one piece) is not "
                       "supported; reasoning_content is streamed as it is generated", "stream_reasoning")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise ApiError("top_logprobs: must be in [0, 20]", "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise ApiError("top_logprobs: requires logprobs to be true", "top_logprobs")
    check_chat_template_kwargs(req.chat_template_kwargs or {}, template_args, allow_client_template)


# What the template call takes as its own arguments, whatever the installed transformers adds
# (`template_call_args` adds the tokenizer's own signature).
TEMPLATE_CALL_ARGS = frozenset({
    "messages", "conversation", "conversations", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


def template_call_args(tokenizer: Any) -> frozenset[str]:
    """The keys `chat_template_kwargs` may not use: the template call's own arguments."""
    try:
        names = set(inspect.signature(tokenizer.apply_chat_template).parameters)
    except (AttributeError, TypeError, ValueError):
        names = set()
    return TEMPLATE_CALL_ARGS | {n for n in names if n not in ("self", "kwargs")}


def check_chat_template_kwargs(kwargs: dict[str, Any], template_args: frozenset[str],
                               allow_client_template: bool) -> None:
    """`chat_template_kwargs` are variables of the chat template: they change the prompt,
    and with it the results. A client's own template (`chat_template`, Jinja the server
    would run) is refused unless --allow-client-chat-template; the other arguments of the
    template call (`template_args`: `tools`, `add_generation_prompt`, ...) are not variables
    and are refused."""
    for key in kwargs:
        if key == "chat_template":
            if not allow_client_template:
                raise ApiError("chat_template_kwargs.chat_template: a client-supplied chat template is refused "
                               "(the server starts with --allow-client-chat-template to accept one)",
                               "chat_template_kwargs")
        elif key in template_args:
            raise ApiError(f"chat_template_kwargs.{key}: is an argument of the template call, not a template "
                           "variable; not supported", "chat_template_kwargs")


def sampling_params(req: OpenAIRequest, max_tokens: int, names: ApiFields) -> SamplingParams:
    """SamplingParams from OpenAI's fields and SGLang's extras. Raises ValueError naming the field."""
    check_new_tokens(max_tokens, req.min_tokens, names)
    return SamplingParams(
        max_new_tokens=max_tokens, min_new_tokens=req.min_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        stop=tuple([req.stop] if isinstance(req.stop, str) else (req.stop or [])),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, n=req.n,
        seed=req.seed, skip_special_tokens=req.skip_special_tokens, no_stop_trim=req.no_stop_trim,
        json_schema=response_format_schema(req.response_format, req.json_schema), regex=req.regex, ebnf=req.ebnf)


def response_format_schema(response_format: Any, json_schema: str | None) -> str | None:
    """The JSON schema (as text) that OpenAI's ``response_format`` asks for, or SGLang's
    ``json_schema`` field when there is none. ``json_object`` asks for any JSON object.
    Raises ValueError naming the field."""
    if response_format is None:
        return json_schema
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ValueError("response_format: must be an object with a string `type`")
    kind = response_format["type"]
    if kind == "text":
        return json_schema
    if json_schema is not None:
        raise ValueError("response_format, json_schema: at most one may constrain the output")
    if kind == "json_object":
        return '{"type": "object"}'
    if kind != "json_schema":
        raise ValueError(f"response_format.type: must be text, json_object or json_schema, got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema: must be an object with a `schema`")
    schema = spec.get("schema", spec.get("schema_"))
    if not isinstance(schema, (dict, bool)):
        raise ValueError("response_format.json_schema.schema: must be a JSON schema object")
    text = json.dumps(schema)
    try:
        check_constraint(SamplingParams(json_schema=text))
    except ValueError as exc:
        raise ValueError(f"response_format.{exc}") from None
    return text


def completion_requests(args: ServerArgs, builder: RequestBuilder, req: CompletionRequest
                        ) -> tuple[list[NewRequest], list[str]]:
    """The messages of a completions body and each prompt's text (what `echo` repeats).
    Raises ValueError naming the field."""
    if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], str)):
        prompts, _ = builder.token_ids(req.prompt, None, "prompt", "prompt")
        texts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
    else:
        prompts, _ = builder.token_ids(None, req.prompt or None, "prompt", "prompt")
        texts = [builder.tokenizer.decode(p) for p in prompts]
    # max_tokens: null means "up to the context length".
    params = [sampling_params(req, req.max_tokens if req.max_tokens is not None
                              else builder.context_len - len(p), COMPLETION_FIELDS) for p in prompts]
    rids = [req.rid] if isinstance(req.rid, str) else req.rid
    # echo + logprobs: the echoed prompt's tokens come with their logprobs (vLLM, OpenAI).
    return builder.build(prompts, params, req.logprobs is not None, req.logprobs or 0, rids,
                         bootstrap_of(args, req, params), COMPLETION_FIELDS,
                         logprob_start_len=0 if req.echo and req.logprobs is not None else -1), texts


def chat_prompt(builder: RequestBuilder, req: ChatCompletionRequest, plan: ToolPlan | None = None) -> str:
    """The conversation rendered by the chat template. Raises ValueError naming the field."""
    return render_chat(builder, req.messages, req.chat_template_kwargs, add_generation_prompt=True,
                       tools=plan.tools if plan is not None else None)


def template_message(i: int, m: ChatMessage) -> dict[str, Any]:
    """One message as chat templates read it. Tool calls in the history get their
    arguments as an object: templates (Qwen's, Llama 3's) write them with `tojson`, and
    a JSON string would come out quoted. Raises ValueError naming the field."""
    if isinstance(m.content, list):
        if any(part.type != "text" for part in m.content):
            raise ValueError("messages: only text content parts are supported")
        content = "".join(part.text or "" for part in m.content)
    else:
        content = m.content or ""
    check_text(content, f"messages[{i}].content")
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.tool_calls is not None:
        if m.role != "assistant":
            raise ValueError(f"messages[{i}].tool_calls: only assistant messages carry tool calls")
        calls = []
        for j, c in enumerate(m.tool_calls):
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                args = json.loads(c.function.arguments) if c.function.arguments.strip() else {}
            except ValueError:
                raise ValueError(f"{where}: is not valid JSON") from None
            if not isinstance(args, dict):
                raise ValueError(f"{where}: must encode a JSON object")
            calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
        out["tool_calls"] = calls
    if m.role == "tool":
        if not m.tool_call_id:
            raise ValueError(f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers")
        out["tool_call_id"] = m.tool_call_id
    elif m.tool_call_id is not None:
        raise ValueError(f"messages[{i}].tool_call_id: only tool messages answer a call")
    if m.name is not None:
        out["name"] = m.name
    return out


def render_chat(builder: RequestBuilder, chat: Sequence[ChatMessage], template_kwargs: dict[str, Any] | None,
                add_generation_prompt: bool, tools: Sequence[dict[str, Any]] | None = None) -> str:
    """`chat` rendered by the chat template (also /tokenize's), with the request's `tools`
    (the template's own `tools` variable). Raises ValueError naming the field."""
    messages = [template_message(i, m) for i, m in enumerate(chat)]
    # Before rendering: the conversation alone (each message at least its role, content and calls).
    builder.check_chars(sum(len(m["role"]) + len(m["content"]) + len(json.dumps(m.get("tool_calls", "")))
                            for m in messages) + len(json.dumps(tools or "")), "messages", "the conversation's ")
    try:
        prompt_text = builder.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                            tokenize=False, tools=tools or None,
                                                            **(template_kwargs or {}))
    except Exception as exc:  # a template that rejects the conversation
        raise ValueError(f"messages: the chat template failed: {exc}") from None
    if not isinstance(prompt_text, str):
        raise ValueError("messages: the chat template did not render one prompt")
    builder.check_chars(len(prompt_text), "messages", "the rendered conversation's ")
    # The contents are checked above, so invalid text here came from the template's kwargs.
    check_text(prompt_text, "chat_template_kwargs")
    return prompt_text


def chat_requests(args: ServerArgs, builder: RequestBuilder, req: ChatCompletionRequest,
                  plan: ToolPlan | None = None) -> list[NewRequest]:
    """The message of a chat body (one prompt); `plan`: its tools. Raises ValueError naming the field."""
    ids = builder.tokenizer(chat_prompt(builder, req, plan), add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("messages: the conversation is empty")
    explicit = req.max_completion_tokens is not None  # the newer name wins over max_tokens
    names = ApiFields(max_new_tokens="max_completion_tokens" if explicit else "max_tokens",
                      min_new_tokens="min_tokens")
    max_tokens = req.max_completion_tokens if explicit else req.max_tokens
    if max_tokens is None:  # up to the context length, at least one token
        max_tokens = max(1, builder.context_len - len(ids))
    params = [constrain_to_tools(sampling_params(req, max_tokens, names), plan)]
    return builder.build([ids], params, req.logprobs, req.top_logprobs or 0, [req.rid] if req.rid else None,
                         bootstrap_of(args, req, params), names)


def constrain_to_tools(params: SamplingParams, plan: ToolPlan | None) -> SamplingParams:
    """`tool_choice` required or a named function: the output is constrained to the plan's
    JSON schema (the grammar machinery's `json_schema`), so that it always parses into
    calls. Raises ValueError naming the field."""
    schema = plan.json_schema() if plan is not None else None
    if schema is None:
        return params
    if any(getattr(params, f, None) is not None for f in ("json_schema", "regex", "ebnf")):
        raise ValueError("tool_choice: 'required' or a named function constrains the output to tool calls; "
                         "it cannot be combined with another output constraint (response_format, ...)")
    return dataclasses.replace(params, json_schema=schema)


# ---- responses ---------------------------------------------------------------------------
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
