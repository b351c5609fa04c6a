"""POST /tokenize and /detokenize in SGLang's and vLLM's shapes, with the server's own
tokenizer and chat template (what /v1/chat/completions would feed the model)."""

from __future__ import annotations

from typing import Any, Sequence

from fastapi import FastAPI

from pdserve.config import ServerArgs
from pdserve.server.openai_requests import check_chat_template_kwargs, check_model, render_chat, template_call_args
from pdserve.server.tool_calls import tool_plan
from pdserve.server.protocol import ApiError, DetokenizeRequest, TokenizeRequest, from_value_error
from pdserve.server.tokenizer_manager import TokenizerManager
from pdserve.requests import MAX_CHARS_PER_TOKEN, check_text


def tokenize(args: ServerArgs, manager: TokenizerManager, req: TokenizeRequest,
             template_args: frozenset[str]) -> list[int]:
    """The token ids of a prompt, or of messages rendered by the chat template (with the
    generation prompt unless `add_generation_prompt` is false). Raises ValueError naming
    the field."""
    b = manager.builder
    if (req.prompt is None) == (req.messages is None):
        raise ValueError("prompt: exactly one of prompt and messages must be given")
    if req.prompt is not None:
        if req.chat_template_kwargs:
            raise ValueError("chat_template_kwargs: applies to messages only")
        if req.tools:
            raise ValueError("tools: apply to messages only")
        b.check_chars(len(req.prompt), "prompt")
        check_text(req.prompt, "prompt")
        text = req.prompt
        special = True if req.add_special_tokens is None else req.add_special_tokens
    else:
        if not req.messages:
            raise ValueError("messages: must not be empty")
        check_chat_template_kwargs(req.chat_template_kwargs or {}, template_args, args.allow_client_chat_template)
        try:
            # The tools as a chat request renders them (checked the same way: duplicate names...).
            plan = tool_plan([t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                             "none", None, None)
            text = render_chat(b, req.messages, req.chat_template_kwargs, req.add_generation_prompt,
                               tools=plan.tools if plan is not None else None)
        except RecursionError:  # JSON nested deeper than Python goes, wherever: a 400, not a 500
            raise ValueError("messages: nested too deeply to render") from None
        special = bool(req.add_special_tokens)  # the template writes its own special tokens
    return list(b.tokenizer(text, add_special_tokens=special)["input_ids"])


def detokenize(manager: TokenizerManager, tokens: Sequence[int]) -> str:
    """The text of `tokens`. Raises ValueError naming the field.

    The response is bounded as /tokenize's input is (issue 39: a token's text is many times
    the bytes of its id, so a small body could ask for a response many times its size):
    at most the context length in tokens, and at most as many characters as a prompt
    may have (`RequestBuilder.max_prompt_chars`)."""
    b = manager.builder
    if len(tokens) > b.context_len:
        raise ValueError(f"tokens: {len(tokens)} tokens, above the limit {b.context_len} (the context length)")
    vocab = b.vocab_size
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab:
            raise ValueError(f"tokens: tokens[{i}] = {t} is outside the vocabulary [0, {vocab})")
    try:
        text = manager.tokenizer.decode(list(tokens))
    except Exception as exc:  # an id the model has but the tokenizer cannot map
        raise ValueError(f"tokens: cannot be decoded: {exc}") from None
    if len(text) > b.max_prompt_chars:
        raise ValueError(f"tokens: their text has {len(text)} characters, above the limit {b.max_prompt_chars} "
                         f"(the longest prompt: the context length x {MAX_CHARS_PER_TOKEN} characters per token)")
    return text


class TokenizeRoutes:
    def __init__(self, args: ServerArgs, manager: TokenizerManager, model_names: Sequence[str]) -> None:
        self.args = args
        self.manager = manager
        self.model_names = tuple(model_names)
        self.template_args = template_call_args(manager.tokenizer)

    def register(self, app: FastAPI) -> None:
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        check_model(req.model, self.model_names)
        try:
            ids = await self.manager.off_loop(tokenize, self.args, self.manager, req, self.template_args)
        except ValueError as exc:
            raise from_value_error(exc) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": self.manager.builder.context_len}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        check_model(req.model, self.model_names)
        try:
            text = await self.manager.off_loop(detokenize, self.manager, req.tokens)
        except ValueError as exc:
            raise ApiError(str(exc), "tokens") from None
        return {"prompt": text}
