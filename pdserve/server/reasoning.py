"""Reasoning content (`--reasoning-parser`): a model's thinking, written between
`<think>` and `</think>`, goes to `reasoning_content`, the rest to `content`.

Two conventions (SGLang's parser names):
- `qwen3`: the output holds reasoning only when a `<think>` tag opens it (nothing but
  whitespace before it, as vLLM's parser splits); once content has started, a `<think>`
  is text (issue 39: a literal tag inside a tool call's arguments moved the rest of the
  answer, the call included, into the reasoning). With `chat_template_kwargs:
  {"enable_thinking": false}` the template closes the thinking in the prompt and the
  whole output is content (`parser_for` returns None then).
- `deepseek-r1`: the chat template already opened the thinking in the prompt, so the
  output starts inside it (a leading `<think>` the model writes anyway is dropped):
  everything up to `</think>` is reasoning.

A think block that is never closed (the output ended first) is reasoning to its end,
as in SGLang: `content` is then empty. After `</think>` everything is content (a second
`<think>` there is text); the whitespace right after the closing tag is dropped.

`ReasoningParser.feed` takes text as it streams and returns what is known so far; a
tag split across chunks is held back until it is complete (or turns out not to be a
tag), so the concatenated deltas of any split equal the parse of the whole text.
"""

from __future__ import annotations

from typing import Any, Mapping

THINK_START = "<think>"
THINK_END = "</think>"
# name -> whether the output starts inside the reasoning
REASONING_PARSERS: dict[str, bool] = {"deepseek-r1": True, "qwen3": False}

# _BEFORE: qwen3's output before anything but whitespace came (a <think> may still open it).
_BEFORE, _REASONING, _CONTENT = "before", "reasoning", "content"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Splits one sample's output into (reasoning, content) incrementally."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.state = _REASONING if starts_in_reasoning else _BEFORE
        self.at_start = True        # nothing but whitespace seen yet: a leading <think> may come
        self.strip_content = False  # just after </think>: drop the whitespace that follows
        self.buffer = ""            # text held back (a possible partial tag, leading whitespace)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content deltas that `text` (the next piece of output) completes."""
        self.buffer += text
        reasoning, content = [], []
        while self.buffer:
            if self.state == _CONTENT:
                piece, self.buffer = self.buffer, ""
                if self.strip_content:
                    piece = piece.lstrip()
                    self.strip_content = not piece
                content.append(piece)
            elif self.at_start:
                # Leading whitespace, then possibly <think>: hold until known.
                head = self.buffer.lstrip()
                if THINK_START.startswith(head):
                    break  # all whitespace or a partial opening tag: wait for more
                self.at_start = False
                if head.startswith(THINK_START):
                    self.buffer = head[len(THINK_START):]
                    self.state = _REASONING
                elif self.state == _BEFORE:
                    self.state = _CONTENT  # qwen3: content came first, a later <think> is text
            else:  # _REASONING
                if not self._take_until(THINK_END, reasoning):
                    break
                self.state = _CONTENT
                self.strip_content = True
        return "".join(reasoning), "".join(content)

    def _take_until(self, tag: str, out: list[str]) -> bool:
        """Moves the buffer's text before `tag` to `out` and drops the tag: True. Without
        the tag, moves all but a possible start of it (kept for the next piece): False."""
        i = self.buffer.find(tag)
        if i >= 0:
            out.append(self.buffer[:i])
            self.buffer = self.buffer[i + len(tag):]
            return True
        cut = len(self.buffer) - _partial_suffix(self.buffer, tag)
        out.append(self.buffer[:cut])
        self.buffer = self.buffer[cut:]
        return False

    def flush(self) -> tuple[str, str]:
        """At the end of the output: what was held back, in the part it was held in (an
        unclosed think block stays reasoning, a partial tag is plain text)."""
        held, self.buffer = self.buffer, ""
        if self.state == _REASONING:
            return held, ""
        if self.state == _CONTENT and self.strip_content:
            held = held.lstrip()
        # Before any reasoning (qwen3): held whitespace or a partial "<think" is content.
        return "", held

    def parse(self, text: str) -> tuple[str, str]:
        """A whole output at once: (reasoning, content)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.flush()
        return r1 + r2, c1 + c2


def parser_for(name: str | None, separate: bool | None,
               chat_template_kwargs: Mapping[str, Any] | None) -> ReasoningParser | None:
    """The parser of one request: None when its output is all content (no
    --reasoning-parser, `separate_reasoning: false`, qwen3 with thinking turned off).
    `separate` None means the default: separate when a parser is configured."""
    if name is None or separate is False:
        return None
    if name == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking") is False:
        return None
    return ReasoningParser(REASONING_PARSERS[name])
