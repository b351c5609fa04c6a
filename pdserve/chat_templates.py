"""Built-in chat templates for `--chat-template NAME`, and how the flag's value becomes
the template /v1/chat/completions renders with.

`--chat-template` takes a Jinja file (its text replaces the tokenizer's template, as in
SGLang and vLLM) or one of the names below. The built-ins are pdserve's own renderings
of well-known conversation formats, for tokenizers that carry no template or the wrong
one; each is rendered by transformers' sandboxed Jinja like any tokenizer template.
A model's own template, when it has one, is the authority: prefer it.

This module imports nothing heavy: the config validates names against it.
"""

from __future__ import annotations

from pathlib import Path

# ChatML (Qwen, Yi, many fine-tunes): <|im_start|>role\ncontent<|im_end|>\n per message.
_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama 3 / 3.1 instruct: a header per message, contents trimmed, <|eot_id|> after each.
_LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Llama 2 chat: [INST] ... [/INST] turns, the system prompt in <<SYS>> inside the first one.
_LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' }}"
    "{% if loop.first and system %}{{ '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}{% endif %}"
    "{{ message['content'] | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
    "{% else %}{{ raise_exception('llama-2-chat: a system message may only come first') }}"
    "{% endif %}"
    "{% endfor %}"
)

# Mistral instruct (v0.1-v0.3 style): [INST] user [/INST] answer</s>; a system message is
# put before the next user message (the format has no system role of its own).
_MISTRAL = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}"
    "{% elif message['role'] == 'user' %}"
    "{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}{% set ns.system = '' %}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "llama-3-instruct": _LLAMA3,
    "llama-3": _LLAMA3,
    "llama-2-chat": _LLAMA2,
    "llama-2": _LLAMA2,
    "mistral": _MISTRAL,
}


class ChatTemplateError(ValueError):
    """The --chat-template value cannot be used; the message names the flag."""


def resolve_chat_template(value: str) -> str:
    """The Jinja text for ``--chat-template value``: a built-in name, else a file's text.
    The template is compiled here, so a syntax error stops the server at startup."""
    if value in BUILTIN_CHAT_TEMPLATES:
        text = BUILTIN_CHAT_TEMPLATES[value]
    else:
        path = Path(value)
        if not path.is_file():
            raise ChatTemplateError(f"--chat-template: {value!r} is neither a file nor a built-in template "
                                    f"(built-in: {', '.join(sorted(BUILTIN_CHAT_TEMPLATES))})")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"--chat-template: cannot read {value!r}: {exc}") from None
        if not text.strip():
            raise ChatTemplateError(f"--chat-template: {value!r} is empty")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"--chat-template: {value!r} is not a valid Jinja template: "
                                f"{exc.message} (line {exc.lineno})") from None
    return text


def apply_chat_template_override(tokenizer: object, value: str | None) -> None:
    """Make ``--chat-template`` the tokenizer's template (the HTTP process renders chats
    with the tokenizer's `apply_chat_template`); nothing when the flag is not given."""
    if value is not None:
        tokenizer.chat_template = resolve_chat_template(value)  # type: ignore[attr-defined]
