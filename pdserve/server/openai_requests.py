"""From an OpenAI body to scheduler messages: what only the OpenAI APIs define (model
names, the chat template and its arguments, tools, response_format) and the
conversion into `NewRequest`s through the shared RequestBuilder (errors name the
OpenAI fields: `max_tokens`, `min_tokens`). Raises ValueError / ApiError naming the
field; `openai_routes` turns them into 400s."""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any, Sequence, Union

from pdserve.config import ServerArgs
from pdserve.requests import ApiFields, RequestBuilder, check_new_tokens, check_text
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.grammar import check_constraint
from pdserve.scheduler.messages import NewRequest
from pdserve.server.http_common import bootstrap_of
from pdserve.server.protocol import (ApiError, ChatCompletionRequest, ChatMessage, CompletionRequest, json_field,
                                     refuse_unsupported)
from pdserve.server.tool_calls import ToolPlan

COMPLETION_FIELDS = ApiFields(max_new_tokens="max_tokens", min_new_tokens="min_tokens")
OpenAIRequest = Union[CompletionRequest, ChatCompletionRequest]


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
    try:
        text = json.dumps(schema)
    except RecursionError:  # not a ValueError: it would leave as a 500
        raise ValueError("response_format.json_schema.schema: nested too deeply to encode") from None
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
    # echo + logprobs: the echoed prompt's tokens come with their logprobs (vLLM, OpenAI),
    # as many as --max-prompt-logprob-entries allows.
    return builder.build(prompts, params, req.logprobs is not None, req.logprobs or 0, rids,
                         bootstrap_of(args, req, params), COMPLETION_FIELDS,
                         logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
                         max_prompt_logprob_entries=args.max_prompt_logprob_entries,
                         prompt_logprobs_field="echo"), texts


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
            args = json_field(c.function.arguments, where) if c.function.arguments.strip() else {}
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
    try:
        chars = sum(len(m["role"]) + len(m["content"]) + len(json.dumps(m.get("tool_calls", "")))
                    for m in messages) + len(json.dumps(tools or ""))
    except RecursionError:  # arguments or tool parameters nested deeper than the encoder goes
        raise ValueError("messages: the tool calls or tools are nested too deeply to encode") from None
    builder.check_chars(chars, "messages", "the conversation's ")
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
    try:
        schema = plan.json_schema() if plan is not None else None
    except RecursionError:  # a tool's parameters nested deeper than the encoder goes
        raise ValueError("tools: a function's parameters are nested too deeply to encode") from None
    if schema is None:
        return params
    if any(getattr(params, f, None) is not None for f in ("json_schema", "regex", "ebnf")):
        raise ValueError("tool_choice: 'required' or a named function constrains the output to tool calls; "
                         "it cannot be combined with another output constraint (response_format, ...)")
    return dataclasses.replace(params, json_schema=schema)


# ---- responses ---------------------------------------------------------------------------
