"""Parsers of the models' own tool-call formats (`--tool-call-parser`, SGLang's names;
`hermes` is vLLM's name for the same format as `qwen`):

- `qwen` / `qwen25` / `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  possibly several; the text outside the tags is content.
- `llama3`: Llama 3.1+ JSON, `{"name": ..., "parameters": {...}}`, at the start of the
  output or after `<|python_tag|>`, several separated by `;`.

One class per format family; `TOOL_CALL_PARSERS` maps the flag's names to them (the
config validates --tool-call-parser against it, so this module imports nothing heavy).
A new format is one `_TextParser` subclass and its names in `TOOL_CALL_PARSERS`.
"""

from __future__ import annotations

import json

from pdserve.server.reasoning import _partial_suffix
from pdserve.server.tool_output import Delta, _as_call, _TextParser, scan_call


class HermesParser(_TextParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5 / 3, Hermes)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self.inside = False  # between START and END

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        self.buffer += text
        content: list[str] = []
        calls: list[Delta] = []
        while True:
            if not self.inside:
                i = self.buffer.find(self.START)
                if i < 0:
                    cut = len(self.buffer) - _partial_suffix(self.buffer, self.START)
                    self._content(self.buffer[:cut], content)
                    self.buffer = self.buffer[cut:]
                    break
                self._content(self.buffer[:i], content)
                self.buffer = self.buffer[i + len(self.START):]
                self.inside = True
            else:
                j = self.buffer.find(self.END)
                if j < 0:
                    break  # the call's JSON is still coming
                body, self.buffer = self.buffer[:j], self.buffer[j + len(self.END):]
                self.inside = False
                self._close(body, self.END, content, calls)
        return "".join(content), calls

    def _close(self, body: str, end: str, content: list[str], calls: list[Delta]) -> None:
        try:
            call = _as_call(json.loads(body), self.names, ("arguments", "parameters"))
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            call = None
        if call is None:  # not a call: the tags and all stay text
            self._content(self.START + body + end, content)
        else:
            self._emit_call(call, calls)

    def flush(self) -> tuple[str, list[Delta]]:
        content: list[str] = []
        calls: list[Delta] = []
        if self.inside:  # never closed (cut at max_tokens, or the model stopped there)
            body, self.buffer, self.inside = self.buffer, "", False
            self._close(body, "", content, calls)
        return "".join(content) + self._flush_content(self.buffer), calls


class Llama3JsonParser(_TextParser):
    """Llama 3.1+ JSON calls: `{"name": ..., "parameters": {...}}` (also `"arguments"`),
    starting the output or after `<|python_tag|>`, several separated by `;`. Text after
    the calls that is not another call ends the calls: the rest is content."""

    TAG = "<|python_tag|>"
    _START, _CONTENT, _CALLS, _AFTER, _TEXT = "start", "content", "calls", "after", "text"

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self.state = self._START
        self.tagged = False  # the JSON being read followed a <|python_tag|> (text again if no call)
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        self.buffer += text
        content: list[str] = []
        calls: list[Delta] = []
        while self.buffer:
            if self.state == self._START:
                head = self.buffer.lstrip()
                if self.TAG.startswith(head):
                    break  # whitespace or a partial tag so far
                if head.startswith(self.TAG):
                    self.buffer, self.state, self.tagged = head[len(self.TAG):], self._CALLS, True
                else:
                    self.state = self._CALLS if head.startswith("{") else self._CONTENT
            elif self.state in (self._CONTENT, self._TEXT):
                i = self.buffer.find(self.TAG) if self.state == self._CONTENT else -1
                if i < 0:
                    cut = len(self.buffer) - (_partial_suffix(self.buffer, self.TAG)
                                              if self.state == self._CONTENT else 0)
                    self._content(self.buffer[:cut], content)
                    self.buffer = self.buffer[cut:]
                    break
                self._content(self.buffer[:i], content)
                self.buffer, self.state, self.tagged = self.buffer[i + len(self.TAG):], self._CALLS, True
            elif self.state == self._AFTER:  # after a call: `;` and the next, or the end
                head = self.buffer.lstrip()
                if not head:
                    break
                if head[0] == ";":
                    self.buffer, self.state = head[1:], self._CALLS
                else:
                    self.state = self._CALLS if head[0] == "{" else self._TEXT
            else:  # _CALLS: a JSON object is expected
                head = self.buffer.lstrip()
                if not head:
                    break
                if head[0] != "{":
                    self._to_text()
                    continue
                scan = scan_call(self.decoder, head, self.names, ("parameters", "arguments"))
                if scan.incomplete:
                    break
                if scan.call is None:
                    self._to_text()  # a JSON answer, not a call: the rest is text
                    continue
                self._emit_call(scan.call, calls)
                self.buffer, self.state, self.tagged = head[scan.end:], self._AFTER, False
        return "".join(content), calls

    def _to_text(self) -> None:
        """No (more) calls: the rest of the output is text, the tag that announced one included."""
        if self.tagged:
            self.buffer, self.tagged = self.TAG + self.buffer, False
        self.state = self._TEXT

    def flush(self) -> tuple[str, list[Delta]]:
        if self.state == self._CALLS:  # an incomplete call: text
            self._to_text()
        rest, self.buffer = self.buffer, ""
        if self.state == self._AFTER:
            rest = rest.lstrip()
        return self._flush_content(rest), []


TOOL_CALL_PARSERS: dict[str, type[_TextParser]] = {
    "qwen": HermesParser, "qwen25": HermesParser, "hermes": HermesParser, "llama3": Llama3JsonParser,
}
