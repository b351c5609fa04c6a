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

Where the rest lives, and why the split is there: this module is the request side (what
`tools` / `tool_choice` ask for, the schema they constrain to, which reader an output
gets); reading an output is split by reader family, each with its own state machine and
none depending on another: tool_output.py (the incremental `ToolOutput` interface and
what the native parsers share), tool_parsers.py (the models' own formats, the
`--tool-call-parser` names) and tool_constrained.py (outputs `required` / a named
function constrain). Their public names are re-exported here. These modules import
nothing heavy: the config validates --tool-call-parser against `TOOL_CALL_PARSERS`.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from pdserve.server.tool_constrained import NamedCall, RequiredCalls
from pdserve.server.tool_output import Delta, ToolOutput, merge_deltas, new_call_id
from pdserve.server.tool_parsers import TOOL_CALL_PARSERS, HermesParser, Llama3JsonParser

__all__ = ["TOOL_CALL_PARSERS", "Delta", "HermesParser", "Llama3JsonParser", "NamedCall", "RequiredCalls",
           "ToolOutput", "ToolPlan", "finish_reason", "merge_deltas", "new_call_id", "parameters_schema",
           "tool_name", "tool_plan"]


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
