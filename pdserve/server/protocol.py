"""Request bodies of the HTTP API (pydantic), with an honest field policy.

Unknown fields are refused (400 naming the field). Fields OpenAI defines that
would change the result but pdserve does not implement (response formats,
logit bias, ...) are accepted by the schema only so that the refusal
can say exactly that. An explicit null for an optional field means its default.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code  # OpenAI's error code (e.g. "model_not_found"); None: the status


def from_value_error(exc: ValueError) -> ApiError:
    """Our validation messages start with the field name: `field: why`."""
    text = str(exc)
    field_name = text.split(":", 1)[0].strip() if ":" in text else None
    return ApiError(text, field_name if field_name and " " not in field_name else None)


def json_field(text: str, field_name: str) -> Any:
    """The JSON a string field carries (a tool call's arguments). Raises ValueError naming
    the field when it does not parse, also when it nests too deeply for the parser: that
    is a RecursionError, which is not a ValueError and would leave as a 500."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{field_name}: JSON nested too deeply to parse") from None
    except ValueError:
        raise ValueError(f"{field_name}: is not valid JSON") from None


@functools.cache
def _defaulted_on_null(model: type[BaseModel]) -> frozenset[str]:
    """Optional fields of `model` whose type cannot hold None."""
    return frozenset(name for name, f in model.model_fields.items()
                     if not f.is_required() and type(None) not in get_args(f.annotation))


class _Strict(BaseModel):
    # strict: "yes" is not a boolean and "2" not a number (OpenAI refuses them too).
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's optional fields are nullable and many clients send an explicit null
        for the ones they leave unset: a null for an optional field that cannot hold
        None stands for its default. Fields typed Optional keep their null (it may mean
        something, e.g. max_tokens: null is "up to the context length")."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in _defaulted_on_null(cls)}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SGLangExtensions(_Strict):
    """SGLang's extra sampling fields on the OpenAI routes (also what its router adds)."""
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    min_tokens: int = 0
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    rid: Optional[str] = None
    # Prefill/decode disaggregation (set by a PD router; per prompt when lists)
    bootstrap_host: Optional[Union[str, list[str]]] = None
    bootstrap_port: Optional[Union[int, list[Optional[int]]]] = None
    bootstrap_room: Optional[Union[int, list[int]]] = None
    # Chat with --reasoning-parser: the thinking in `reasoning_content` (true, the default)
    # or left in `content` (false). As in SGLang, whose router sends true with every
    # request, there is nothing to separate without a parser (nor on completions).
    separate_reasoning: Optional[bool] = None
    # Chat: reasoning_content is streamed as generated (true, the default); false is refused.
    stream_reasoning: Optional[bool] = None
    # Accepted and without effect on the tokens (SGLang's router sends it).
    spaces_between_special_tokens: Optional[bool] = None
    # Changes the prompt, so results: variables of the chat template (e.g. enable_thinking).
    # Its key "chat_template" (a client's own Jinja) is refused unless
    # --allow-client-chat-template, arguments of the template call always
    # (`openai_requests.check_chat_template_kwargs`).
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # Constrained decoding (at most one, nor with response_format): a JSON schema as a
    # string, a regular expression, an EBNF grammar.
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    ebnf: Optional[str] = None
    # OpenAI's: {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema":
    # {"name": ..., "schema": {...}}} (checked by `openai_requests.response_format_schema`).
    response_format: Optional[Any] = None
    # Would change results: refused when set.
    continue_final_message: Optional[bool] = None
    return_hidden_states: Optional[bool] = None
    lora_path: Optional[Any] = None


# Fields refused whenever they are set to something other than "off".
UNSUPPORTED = ("functions", "function_call", "logit_bias",
               "suffix", "audio", "modalities", "prediction", "web_search_options", "return_hidden_states",
               "lora_path", "reasoning_effort", "continue_final_message",
               "background", "return_bytes", "return_entropy", "return_routed_experts",
               "token_ids_logprob", "image_data")
_OFF_VALUES: tuple[Any, ...] = (None, False, {}, [], "none", "auto", "text", {"type": "text"})


class CompletionRequest(SGLangExtensions):
    rid: Optional[Union[str, list[str]]] = None  # one per prompt for a list of prompts
    model: Optional[str] = None
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    best_of: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[int] = None
    echo: bool = False
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    user: Optional[str] = None
    suffix: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON-encoded, as OpenAI sends it back


class AssistantToolCall(_Strict):
    """A call in the history: what an earlier answer's `tool_calls` held."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[AssistantToolCall]] = None  # assistant messages only
    tool_call_id: Optional[str] = None                    # tool messages only (required there)


class FunctionDefinition(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; absent: no arguments
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SGLangExtensions):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    parallel_tool_calls: Optional[bool] = None
    service_tier: Optional[str] = None
    # Tool calling (pdserve/server/tool_calls.py): tool_choice defaults to "auto" with tools.
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    logit_bias: Optional[dict[str, float]] = None
    audio: Optional[Any] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    reasoning_effort: Optional[str] = None


class TokenizeRequest(_Strict):
    """POST /tokenize (SGLang's and vLLM's shape): a prompt, or messages rendered by the
    chat template."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    # Default: true for a prompt, false for messages (the template writes its own).
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Tool]] = None  # messages only: rendered as a chat request's tools are


class DetokenizeRequest(_Strict):
    """POST /detokenize: token ids back to text."""
    model: Optional[str] = None
    tokens: list[int]


class GenerateRequest(_Strict):
    """SGLang's native /generate."""
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: Optional[int] = None   # -1 (or unset): output logprobs only; >= 0: prompt logprobs too
    return_text_in_logprobs: Optional[bool] = None  # true: logprob entries carry the token's text
    stream: bool = False
    rid: Optional[Union[str, list[str]]] = None
    # Prefill/decode disaggregation (set by a PD router; per sample when lists)
    bootstrap_host: Optional[Union[str, list[str]]] = None
    bootstrap_port: Optional[Union[int, list[Optional[int]]]] = None
    bootstrap_room: Optional[Union[int, list[int]]] = None
    # What SGLang's router adds to every /generate body. Without effect here:
    model: Optional[str] = None
    log_metrics: Optional[bool] = None
    no_logs: Optional[bool] = None
    # Would change the response: refused when set. SGLang's benchmark client sends
    # lora_path null and return_routed_experts false with every request.
    return_hidden_states: Optional[bool] = None
    background: Optional[bool] = None
    return_bytes: Optional[bool] = None
    return_entropy: Optional[bool] = None
    return_routed_experts: Optional[bool] = None
    lora_path: Optional[Any] = None
    token_ids_logprob: Optional[list[int]] = None
    image_data: Optional[Any] = None


def refuse_unsupported(req: BaseModel) -> None:
    for name in UNSUPPORTED:
        if name in type(req).model_fields:
            value = getattr(req, name)
            if value not in _OFF_VALUES:
                raise ApiError(f"{name}: is not supported by pdserve", name)
