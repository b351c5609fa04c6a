"""Tool calling on /v1/chat/completions: which tools a request offers, how its
`tool_choice` shapes the output, and how one sample's output becomes `content` plus
OpenAI `tool_calls`.

`tool_choice` (OpenAI's values):
- `auto` (the default when `tools` are given): the model decides, in its own format;
  the `--tool-call-parser` of the server reads the calls out of the text. Without
  the flag the request is refused: nothing could read the calls.
- `none`: the tools still go to the chat template (the model knows them, as with
  OpenAI and vLLM's default), the output is not parsed: all content.
- `required` / a named function (`{"type": "function", "function": {"name": ...}}`):
  the output is constrained by a JSON schema (the sampling parameter `json_schema`)
  whatever the model's native format, as vLLM does: `required` to a JSON array of
  `{"name": <a declared tool>, "parameters": <its parameters>}` (one item when
  `parallel_tool_calls` is false), a named function to its parameters object itself.
  That JSON is turned into `tool_calls`; no parser is needed.

Parsers of the models' own formats (`--tool-call-parser`, SGLang's names; `hermes` is
vLLM's name for the same format as `qwen`):
- `qwen` / `qwen25` / `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  possibly several; the text outside the tags is content.
- `llama3`: Llama 3.1+ JSON, `{"name": ..., "parameters": {...}}`, at the start of the
  output or after `<|python_tag|>`, several separated by `;`.

A call whose JSON does not parse, lacks a name or names a function the request did not
declare stays in `content` as text (never silently dropped). Whitespace between a call
and the text around it is dropped; an output without calls is content unchanged.

Each `ToolOutput.feed` takes the text as it streams and returns the content delta and
OpenAI tool-call deltas it completes; a call is emitted once it is complete (its
arguments in one delta, or, for a named function, as they are generated), so the
concatenated deltas of any split equal `parse` of the whole text. This module imports
nothing heavy: the config validates names against it.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from typing import Any, Mapping, Sequence

from pdserve.server.reasoning import _partial_suffix

Delta = dict[str, Any]  # one OpenAI `delta.tool_calls` item


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_name(tool: Mapping[str, Any]) -> str:
    return tool["function"]["name"]


def parameters_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema; a tool that declares none takes no arguments (`{}`)."""
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}, "additionalProperties": False}


# ---- what a request asks for -------------------------------------------------------------
class ToolPlan:
    """The tools of one chat request and what its `tool_choice` makes of the output."""

    def __init__(self, tools: Sequence[Mapping[str, Any]], mode: str, name: str | None,
                 parser: str | None, parallel: bool) -> None:
        self.tools = list(tools)
        self.mode = mode          # "none", "auto", "required" or "named"
        self.name = name          # the named function's name ("named" only)
        self.parser = parser      # --tool-call-parser ("auto" only)
        self.parallel = parallel  # more than one call allowed ("required" only)

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def json_schema(self) -> str | None:
        """The JSON schema the output is constrained to (`required` / named), encoded."""
        if self.mode == "named":
            tool = next(t for t in self.tools if tool_name(t) == self.name)
            return json.dumps(parameters_schema(tool))
        if self.mode == "required":
            items = [{"type": "object",
                      "properties": {"name": {"type": "string", "enum": [tool_name(t)]},
                                     "parameters": parameters_schema(t)},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": items[0] if len(items) == 1 else {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return json.dumps(schema)
        return None

    def new_output(self) -> "ToolOutput | None":
        """A fresh reader of one sample's output; None when the output is all content."""
        names = frozenset(tool_name(t) for t in self.tools)
        if self.mode == "auto":
            return TOOL_CALL_PARSERS[self.parser](names)  # type: ignore[index]
        if self.mode == "named":
            return NamedCall(self.name)  # type: ignore[arg-type]
        if self.mode == "required":
            return RequiredCalls(names)
        return None


def tool_plan(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None,
              parser: str | None) -> ToolPlan | None:
    """The plan of a request's `tools` / `tool_choice` (plain JSON values, shapes already
    checked by the request model); None when it offers no tools. Raises ValueError naming
    the field for what the shapes cannot say: duplicate names, a choice naming no
    declared tool, `auto` on a server without --tool-call-parser."""
    if isinstance(tool_choice, Mapping):
        mode, name = "named", tool_choice["function"]["name"]
    else:
        mode, name = (tool_choice or "auto"), None
    if not tools:
        if mode in ("required", "named"):
            raise ValueError(f"tool_choice: {mode!r} needs `tools` (none were given)")
        return None
    seen: set[str] = set()
    for i, t in enumerate(tools):
        n = tool_name(t)
        if not n:
            raise ValueError(f"tools[{i}].function.name: must not be empty")
        if n in seen:
            raise ValueError(f"tools[{i}].function.name: {n!r} is declared twice")
        seen.add(n)
    if mode == "named" and name not in seen:
        raise ValueError(f"tool_choice: names the function {name!r}, which is not among the tools "
                         f"({', '.join(sorted(seen))})")
    if mode == "auto" and parser is None:
        raise ValueError("tools: tool_choice 'auto' (the default with tools) needs a server started with "
                         f"--tool-call-parser ({' | '.join(TOOL_CALL_PARSERS)}), which reads the calls out of the "
                         "model's output; tool_choice 'required', a named function and 'none' work without it")
    return ToolPlan(tools, mode, name, parser if mode == "auto" else None, parallel_tool_calls is not False)


def finish_reason(finish: str | None, output: "ToolOutput | None") -> str | None:
    """OpenAI's `tool_calls` for an answer that stopped (not one cut at max_tokens) with calls."""
    if finish == "stop" and output is not None and output.calls:
        return "tool_calls"
    return finish


def merge_deltas(deltas: Sequence[Delta]) -> list[dict[str, Any]]:
    """Whole tool calls from their streamed deltas (arguments concatenated per index)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.get(d["index"])
        if call is None:
            calls[d["index"]] = {"id": d["id"], "type": "function",
                                 "function": {"name": d["function"]["name"],
                                              "arguments": d["function"].get("arguments", "")}}
        else:
            call["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


# ---- reading one sample's output ---------------------------------------------------------
class ToolOutput(ABC):
    """Splits one sample's output into content and tool calls incrementally."""

    def __init__(self) -> None:
        self.calls = 0  # calls emitted so far (the next one's index)

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[Delta]]:
        """The content delta and the tool-call deltas that `text` (the next piece) completes."""

    @abstractmethod
    def flush(self) -> tuple[str, list[Delta]]:
        """At the end of the output: what was held back."""

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """A whole output at once: (content, tool_calls)."""
        c1, d1 = self.feed(text)
        c2, d2 = self.flush()
        return c1 + c2, merge_deltas(d1 + d2)

    def _call(self, name: str, arguments: str) -> Delta:
        """The first (here: only) delta of the next call."""
        delta = {"index": self.calls, "id": new_call_id(), "type": "function",
                 "function": {"name": name, "arguments": arguments}}
        self.calls += 1
        return delta


def _as_call(obj: Any, names: frozenset[str], args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, None if it is not a call of a
    declared tool. Arguments may be an object or a JSON string holding one; absent: `{}`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    try:
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            return None
        return obj["name"], json.dumps(args, ensure_ascii=False)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return None


class _TextParser(ToolOutput):
    """Content handling shared by the native-format parsers: whitespace at the end of the
    content is held back (a call may follow: then it is dropped), whitespace right after
    a call is dropped."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__()
        self.names = names
        self.buffer = ""         # text not classified yet
        self.held_ws = ""        # trailing whitespace of the content so far
        self.after_call = False  # drop the whitespace that follows a call

    def _content(self, piece: str, out: list[str]) -> None:
        if self.after_call:
            piece = piece.lstrip()
            if not piece:
                return
            self.after_call = False
        text = self.held_ws + piece
        kept = text.rstrip()
        self.held_ws = text[len(kept):]
        out.append(kept)

    def _emit_call(self, call: tuple[str, str], calls: list[Delta]) -> None:
        self.held_ws = ""  # the whitespace before a call is not content
        self.after_call = True
        calls.append(self._call(*call))

    def _flush_content(self, rest: str) -> str:
        out: list[str] = []
        self._content(rest, out)
        held, self.held_ws = self.held_ws, ""
        return "".join(out) + ("" if self.after_call else held)


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
                if "}" not in head:
                    break
                try:
                    obj, end = self.decoder.raw_decode(head)
                except RecursionError:  # nested deeper than the parser goes: not a call, text
                    self._to_text()
                    continue
                except ValueError:
                    break  # incomplete (or malformed: then it is content at the end)
                call = _as_call(obj, self.names, ("parameters", "arguments"))
                if call is None:
                    self._to_text()  # a JSON answer, not a call: the rest is text
                    continue
                self._emit_call(call, calls)
                self.buffer, self.state, self.tagged = head[end:], self._AFTER, False
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


class NamedCall(ToolOutput):
    """`tool_choice` naming a function: the output is its arguments (constrained to its
    parameters schema), streamed as they come, after a first delta with id and name."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        if not text:
            return "", []
        if not self.calls:
            return "", [self._call(self.name, text)]
        return "", [{"index": 0, "function": {"arguments": text}}]

    def flush(self) -> tuple[str, list[Delta]]:
        return "", []


class RequiredCalls(ToolOutput):
    """`tool_choice: required`: the output is a JSON array of {"name", "parameters"}
    (constrained); each item becomes a call as soon as it is complete. An output cut
    short (max_tokens) keeps its complete calls; the cut item's text is content. Text
    that is not such an array (never, under the grammar) is content."""

    _OPEN, _ITEM, _SEP, _DONE, _TEXT = "open", "item", "sep", "done", "text"

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__()
        self.names = names
        self.buffer = ""
        self.state = self._OPEN
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        self.buffer += text
        calls: list[Delta] = []
        while self.state != self._TEXT:
            head = self.buffer.lstrip()
            if not head:
                break
            if self.state == self._OPEN:
                if head[0] != "[":
                    self.state = self._TEXT
                    break
                self.buffer, self.state = head[1:], self._ITEM
            elif self.state == self._ITEM:
                if "}" not in head:
                    break
                try:
                    obj, end = self.decoder.raw_decode(head)
                except RecursionError:  # nested deeper than the parser goes: not a call, text
                    self._to_text()
                    break
                except ValueError:
                    break  # the item is still coming
                call = _as_call(obj, self.names, ("parameters",))
                if call is None:
                    self._to_text()
                    break
                calls.append(self._call(*call))
                self.buffer, self.state = head[end:], self._SEP
            elif self.state == self._SEP and head[0] in ",]":
                self.buffer, self.state = head[1:], self._ITEM if head[0] == "," else self._DONE
            else:  # anything after the array, or between items, that does not belong there
                self._to_text()
        if self.state == self._TEXT:
            content, self.buffer = self.buffer, ""
            return content, calls
        return "", calls

    def _to_text(self) -> None:
        if not self.calls:  # nothing was a call: the whole output is text, the "[" included
            self.buffer = "[" + self.buffer
        self.state = self._TEXT

    def flush(self) -> tuple[str, list[Delta]]:
        rest, self.buffer = self.buffer, ""
        if not self.calls and self.state not in (self._OPEN, self._TEXT):  # no call at all: all text
            rest = "[" + rest
        return rest.strip(), []  # a cut item (or nothing but whitespace)


TOOL_CALL_PARSERS: dict[str, type[_TextParser]] = {
    "qwen": HermesParser, "qwen25": HermesParser, "hermes": HermesParser, "llama3": Llama3JsonParser,
}
