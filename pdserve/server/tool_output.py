"""Reading one sample's output as content plus OpenAI tool calls, incrementally: the
interface every reader has (`ToolOutput`) and what the native-format parsers share.

Each `ToolOutput.feed` takes the text as it streams and returns the content delta and
OpenAI tool-call deltas it completes; a call is emitted once it is complete (its
arguments in one delta, or, for a named function, as they are generated), so the
concatenated deltas of any split equal `parse` of the whole text.

A call whose JSON does not parse, lacks a name or names a function the request did not
declare stays in `content` as text (never silently dropped). Whitespace between a call
and the text around it is dropped; an output without calls is content unchanged.

The readers themselves live by family: the models' own formats (`--tool-call-parser`)
in tool_parsers.py, the outputs `tool_choice` constrains in tool_constrained.py; what a
request asks for, and which reader it gets, in tool_calls.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
import uuid
from abc import ABC, abstractmethod
from typing import Any, Sequence

Delta = dict[str, Any]  # one OpenAI `delta.tool_calls` item


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


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


@dataclass(frozen=True)
class CallScan:
    """What the JSON object at the head of a streaming parser's buffer turned out to be:
    a call (name, arguments JSON) ending at ``end``; still ``incomplete``; or neither
    (not a call of a declared tool, or nested deeper than the parser goes: text)."""
    call: tuple[str, str] | None = None
    end: int = 0
    incomplete: bool = False


def scan_call(decoder: json.JSONDecoder, head: str, names: frozenset[str], args_keys: tuple[str, ...]) -> CallScan:
    """Decode the call object ``head`` starts with (the native formats' one way to read one)."""
    if "}" not in head:
        return CallScan(incomplete=True)
    try:
        obj, end = decoder.raw_decode(head)
    except RecursionError:  # nested deeper than the parser goes: not a call, text
        return CallScan()
    except ValueError:
        return CallScan(incomplete=True)  # still coming (or malformed: then it is content at the end)
    return CallScan(_as_call(obj, names, args_keys), end)


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
