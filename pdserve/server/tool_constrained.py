"""Readers of the outputs `tool_choice` constrains (no parser needed: the grammar fixes
the shape): a named function's output is its arguments object, `required`'s a JSON array
of `{"name", "parameters"}` items (tool_calls.py builds both schemas)."""

from __future__ import annotations

import json

from pdserve.server.tool_output import Delta, ToolOutput, scan_call


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
    short (max_tokens) keeps its complete calls and drops the cut item (see flush). Text
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
                scan = scan_call(self.decoder, head, self.names, ("parameters",))
                if scan.incomplete:
                    break  # the item is still coming
                if scan.call is None:
                    self._to_text()
                    break
                calls.append(self._call(*scan.call))
                self.buffer, self.state = head[scan.end:], self._SEP
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
        if self.state == self._TEXT:
            return rest.strip(), []
        # Cut short (max_tokens) inside the array: its complete calls stand and the cut
        # item is dropped, never made content (half a call is neither); finish_reason
        # "length" tells the client. Left in any other state, `rest` is whitespace.
        return "", []
