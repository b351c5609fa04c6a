"""The one way a test waits for something another thread or process does: poll a
condition until it holds. Tests order themselves on what they can observe (a request
in /get_server_info, a worker marked down, a room's state), never on a sleep."""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def _describe(cond: Callable[[], Any]) -> str:
    try:
        return " ".join(inspect.getsource(cond).split())
    except (OSError, TypeError):
        return repr(cond)


def wait_until(cond: Callable[[], T], timeout: float = 10.0, *, step: float = 0.05,
               what: str | Callable[[], str] | None = None,
               ignore: tuple[type[BaseException], ...] = (),
               between: Callable[[], Any] | None = None) -> T:
    """Call `cond()` every `step` seconds until it returns something truthy, and return that.

    After `timeout` seconds it raises AssertionError naming what was awaited: `what`
    (a string, or a callable asked then, e.g. for the state worth showing), else the
    source line of `cond`, and cond's last value. Exceptions of the types in `ignore`
    count as "not yet" (e.g. httpx.HTTPError while a server starts); any other
    exception ends the wait at once. `between` runs after each check that failed (e.g.
    one step of a scheduler the test drives itself)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = cond()
        except ignore as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            desc = what() if callable(what) else what
            raise AssertionError(f"not reached in {timeout:g} s: {desc or _describe(cond)} "
                                 f"(last value: {last!r})")
        if between is not None:
            between()
        time.sleep(step)
