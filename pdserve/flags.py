"""Command lines as every pdserve entry point parses them (`pdserve serve` /
`python -m pdserve.launch_server`, `pdserve up`, the router, `python -m pdserve.generate`).

SGLang's parser shape, with errors that read at once:

- a unique prefix of a flag stands for it (`--speculative-algo EAGLE`), as SGLang's
  argparse parser takes; an ambiguous one is an error naming the candidates;
- every problem of one command line is reported together: each unknown flag (with a
  "did you mean" hint from the known flags), each ambiguous prefix, each bad value
  (type or choice) -- not only the first;
- no usage block: the error lines only (`--help` prints the flags).

`FlagParser.parse_collecting` returns the problems instead of raising, so a command that
forwards flags to another (`pdserve up` to its servers) reports both parsers' problems
in one message. Nothing here imports torch: `pdserve up` parses before it loads anything.
"""

from __future__ import annotations

import argparse
import difflib
import re
from typing import Any, Callable, Collection, Sequence


class _BadValue:
    """A value the flag's type or choices refused, kept in the namespace so that the
    parse goes on and every bad value is reported (argparse stops at the first)."""

    def __init__(self, why: str) -> None:
        self.why = why


class _Checked:
    """The flag's `type` (and choices), returning a `_BadValue` instead of raising."""

    def __init__(self, convert: Callable[[str], Any] | None, choices: Collection[Any] | None) -> None:
        self.convert = convert
        self.choices = choices
        self.__name__ = getattr(convert, "__name__", "str")  # argparse reads it for its own messages

    def __call__(self, text: str) -> Any:
        try:
            value = self.convert(text) if self.convert is not None else text
        except argparse.ArgumentTypeError as exc:
            return _BadValue(str(exc))
        except (TypeError, ValueError):
            return _BadValue(f"invalid {self.__name__} value: {text!r}")
        if self.choices is not None and value not in self.choices:
            return _BadValue(f"invalid choice {text!r} (choose from {', '.join(map(str, self.choices))})")
        return value


_ARGUMENT_MESSAGE = re.compile(r"^argument ([^:]+): (.*)$", re.S)


class FlagParser(argparse.ArgumentParser):
    """argparse with unique prefixes expanded up front, every problem collected, and
    errors raised as `error_class` (each entry point's ConfigError) without a usage block."""

    def __init__(self, *args: Any, error_class: type[Exception] = ValueError, **kwargs: Any) -> None:
        # Set before argparse's __init__, which adds --help through add_argument.
        self._error_class = error_class
        self._flag_actions: dict[str, argparse.Action] = {}
        kwargs["allow_abbrev"] = False  # expand_prefixes does it, naming ambiguity and unknown flags
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        choices = kwargs.pop("choices", None)
        takes_value = kwargs.get("action") in (None, "store", "append", "extend")
        if takes_value:
            if choices is not None and kwargs.get("metavar") is None:
                kwargs["metavar"] = "{" + ",".join(map(str, choices)) + "}"  # what argparse would show
            kwargs["type"] = _Checked(kwargs.get("type"), tuple(choices) if choices is not None else None)
        elif choices is not None:
            kwargs["choices"] = choices
        action = super().add_argument(*args, **kwargs)
        for name in action.option_strings:
            self._flag_actions[name] = action
        return action

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise self._error_class(message)

    @property
    def flag_names(self) -> tuple[str, ...]:
        """Every --flag this parser takes, in the order they were added."""
        return tuple(n for n in self._flag_actions if n.startswith("--"))

    def parse_collecting(self, argv: Sequence[str], *, forward_to: "FlagParser | None" = None
                         ) -> tuple[argparse.Namespace | None, list[str], list[str]]:
        """Parse ``argv``: (namespace, forwarded, problems). With ``forward_to``, the flags
        only it knows (prefixes expanded against both parsers) come back in
        ``forwarded``, with their values and in order, for it to parse; without, anything
        left over is a problem. The namespace is None when argparse itself stopped (a
        flag missing its value)."""
        known: dict[str, object] = dict(self._flag_actions)  # a flag both take is this parser's
        if forward_to is not None:
            known.update((k, v) for k, v in forward_to._flag_actions.items() if k not in known)
        argv, problems = expand_prefixes(argv, known)
        try:
            ns, extras = self.parse_known_args(argv)
        except self._error_class as exc:
            return None, [], problems + [_argparse_message(str(exc))]
        if forward_to is None and extras:
            problems += [_stray(extra, self._flag_actions) for extra in extras]
            extras = []
        for action in self._actions:
            for bad in _bad_values(getattr(ns, action.dest, None)):
                problems.append(f"{action.option_strings[0] if action.option_strings else action.dest}: "
                                f"{bad.why}")
        return ns, list(extras), problems

    def parse_or_raise(self, argv: Sequence[str]) -> argparse.Namespace:
        """The namespace, or one `error_class` listing every problem (one per line)."""
        ns, _, problems = self.parse_collecting(argv)
        raise_problems(problems, self._error_class)
        assert ns is not None
        return ns


def is_bad(value: Any) -> bool:
    """Whether a namespace value is one the flag's type or choices refused (reported
    among the problems); checks of parsed values skip those."""
    return bool(_bad_values(value))


def _stray(token: str, known: Collection[str]) -> str:
    if token.startswith("-") and not _NUMBER.match(token):  # -x: a short flag nobody defines
        return f"{token}: unknown flag{did_you_mean('-' + token.lstrip('-'), known)}"
    return f"{token!r}: unexpected argument (a value without its flag?)"


_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _bad_values(value: Any) -> list[_BadValue]:
    if isinstance(value, _BadValue):
        return [value]
    if isinstance(value, (list, tuple)):
        return [b for v in value for b in _bad_values(v)]
    return []


def _argparse_message(message: str) -> str:
    """argparse's "argument --port: expected one argument" as "--port: expected one argument"."""
    m = _ARGUMENT_MESSAGE.match(message)
    return f"{m.group(1).split('/')[0]}: {m.group(2)}" if m else message


def raise_problems(problems: Sequence[str], error_class: type[Exception]) -> None:
    if problems:
        raise error_class("\n".join(problems))


def did_you_mean(name: str, known: Collection[str]) -> str:
    """' (did you mean --x?)' for the closest known flags, '' when none is close."""
    close = difflib.get_close_matches(name, [k for k in known if k.startswith("--")], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def expand_prefixes(argv: Sequence[str], known: dict[str, object]) -> tuple[list[str], list[str]]:
    """``argv`` with each --flag's unique prefix written out in full (`--flag=value` too),
    and the problems: ambiguous prefixes (naming the candidates) and unknown flags (with a
    hint). ``known`` maps every flag to what it does: spellings of one flag (an alias)
    map to the same object, so a prefix of both is not ambiguous. A bad flag is dropped
    with the values after it, so they are not reported again as stray arguments."""
    out: list[str] = []
    problems: list[str] = []
    skipping = False
    for i, token in enumerate(argv):
        if token == "--":  # what follows is positional, as in argparse
            out += argv[i:]
            break
        if not token.startswith("--"):
            if not skipping:
                out.append(token)
            continue
        skipping = False
        name, eq, value = token.partition("=")
        if name in known:
            out.append(token)
            continue
        matches = [k for k in known if k.startswith(name)]
        if len({id(known[m]) for m in matches}) == 1:
            out.append(matches[0] + eq + value)
            continue
        if matches:
            more = f" and {len(matches) - 6} more" if len(matches) > 6 else ""
            problems.append(f"ambiguous option: {name} could match {', '.join(matches[:6])}{more}")
        else:
            problems.append(f"{name}: unknown flag{did_you_mean(name, known)}")
        skipping = True
    return out, problems


def error_lines(prog: str, exc: BaseException) -> str:
    """What a command prints for a configuration error: one `PROG: error: ...` line per
    problem, and nothing else (no usage block)."""
    return "".join(f"{prog}: error: {line}\n" for line in str(exc).splitlines() or [""])
