"""Logs of the server and router processes a test session has running.

A failing end-to-end test usually fails in a child process (a scheduler
exception ends its server); the test only sees a refused connection or a 5xx.
``tests/conftest.py`` attaches the tail of every running process's log to a
failed test's report, so CI shows the child's traceback before the fixtures
close the process and delete its log.
"""

from __future__ import annotations

from pathlib import Path

TAIL_CHARS = 4000

_running: dict[str, str] = {}  # log path -> label (this test session's processes only)


def register(log_path: str, label: str) -> None:
    _running[log_path] = label


def unregister(log_path: str) -> None:
    _running.pop(log_path, None)


def tails() -> list[tuple[str, str]]:
    """(label, last TAIL_CHARS of its log) for every registered process."""
    out = []
    for path, label in list(_running.items()):
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        out.append((label, text[-TAIL_CHARS:]))
    return out
