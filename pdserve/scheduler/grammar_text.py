"""Grammar text: what a constraint costs, before anything compiles it.

Split from ``grammar.py`` along the line between *text* and *compiled grammars*: this
module measures, parses and checks a request's ``json_schema`` / ``regex`` / ``ebnf`` text
and keys it by digest, and needs no tokenizer, no compiler thread and no torch. The HTTP
process (``server/grammar_check.py``), ``requests.py`` and the grammar worker process use
it alone; a scheduler's compiler (``grammar.py``) and the per-request matcher
(``grammar_state.py``) build on it. ``ByteLRU`` lives here because both sides cache by
digest with it (the HTTP process's verdicts, the offline path's ``_checked``, the
scheduler's compiled grammars).

See ``grammar.py``'s docstring for how the stages bound a grammar's work (issue 39).
Every name here is also importable from ``pdserve.scheduler.grammar``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.grammar_numbers import bound_numbers

# Known-valid grammars the offline path remembers (digests only: 32 bytes each).
CHECKED_ENTRIES = 4096
# What a cache entry costs beyond its measured value (the key, the dict slot, the object).
ENTRY_OVERHEAD = 200
# xgrammar's messages start with "[time] /path/file.cc:line: "; users need the rest.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'        # (EBNF text, as xgrammar prints it)
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
FLAG_BYTES, FLAG_DEPTH, FLAG_TIMEOUT = "--grammar-max-bytes", "--grammar-max-depth", "--grammar-compile-timeout"


@dataclass(frozen=True)
class GrammarLimits:
    """What one grammar may cost (see ``grammar.py``'s docstring; defaults are the flags')."""
    max_bytes: int = 1 << 20
    max_depth: int = 64
    timeout: float = 30.0          # seconds to parse (HTTP process) and to compile (scheduler), each
    cache_bytes: int = 256 << 20   # each process's grammar cache

    @classmethod
    def from_args(cls, args: Any) -> "GrammarLimits":
        return cls(args.grammar_max_bytes, args.grammar_max_depth, args.grammar_compile_timeout,
                   args.grammar_cache_bytes)


# ---- measuring and parsing grammar text --------------------------------------------------
def digest(kind: str, text: str) -> bytes:
    """The cache key of a grammar: 32 bytes, whatever the size of its text."""
    return hashlib.sha256(kind.encode() + b"\0" + text.encode("utf-8", "surrogatepass")).digest()


# What does not nest, per kind, removed before brackets are counted: JSON strings; a
# regex's escapes and character classes; an EBNF's strings, character classes, comments.
_NOT_NESTING = {
    "json_schema": re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S),
    "regex": re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]", re.S),
    "ebnf": re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*', re.S),
}
_BRACKETS = {"json_schema": ("[{", "]}"), "regex": ("(", ")"), "ebnf": ("(", ")")}


def nesting_depth(kind: str, text: str) -> int:
    """How deeply ``text`` nests: JSON arrays and objects of a schema, parentheses of a
    regex or EBNF grammar. Linear, at C speed (regular expressions and itertools)."""
    opens, closes = _BRACKETS[kind]
    stripped = _NOT_NESTING[kind].sub("", text)
    brackets = re.sub(f"[^{re.escape(opens + closes)}]", "", stripped)
    step = dict.fromkeys(opens, 1) | dict.fromkeys(closes, -1)
    return max(itertools.accumulate(map(step.__getitem__, brackets)), default=0)


def check_limits(kind: str, text: str, limits: GrammarLimits) -> None:
    """Raise ValueError naming the field and the flag when ``text`` is too large or nests
    too deeply to be parsed at a bounded cost (before anything parses it)."""
    if len(text) > limits.max_bytes:  # (characters <= bytes: no need to encode to know)
        raise ValueError(f"{kind}: more than {limits.max_bytes} bytes ({len(text)} characters), "
                         f"above the limit ({FLAG_BYTES})")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"{kind}: is not valid Unicode (unpaired surrogate at position {exc.start})") from None
    if size > limits.max_bytes:
        raise ValueError(f"{kind}: {size} bytes, above the limit of {limits.max_bytes} ({FLAG_BYTES})")
    depth = nesting_depth(kind, text)
    if depth > limits.max_depth:
        raise ValueError(f"{kind}: nested {depth} levels deep, above the limit of {limits.max_depth} "
                         f"({FLAG_DEPTH})")


def _parse(kind: str, text: str) -> Any:
    import xgrammar as xgr

    if kind == "json_schema":
        # Compact JSON: a free-whitespace grammar lets a model pad forever between
        # tokens and run out of budget before the value closes.
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False)
        # xgrammar's strings with minLength / maxLength take any character but quote,
        # backslash, CR and LF, so raw control characters (a tab) make the output
        # invalid JSON (mlc-ai/xgrammar#800); exclude them as its unbounded strings do.
        ebnf = str(grammar)
        fixed = ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)
        # Number literals bounded to what a double / an int64 holds: unbounded digit runs
        # let a model write digits until max_tokens (grammar_numbers.py).
        fixed = bound_numbers(fixed)
        return grammar if fixed == ebnf else xgr.Grammar.from_ebnf(fixed)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    raise ValueError(f"{kind}: not a constraint kind")


def parse_grammar(kind: str, text: str) -> Any:
    """xgrammar's Grammar of a constraint; ValueError naming the field with the
    compiler's message when it is invalid."""
    if kind == "json_schema":
        try:
            json.loads(text)
        except RecursionError:  # (the HTTP process refused it by depth before; the Engine did not)
            raise ValueError(f"{kind}: nested too deeply to parse") from None
        except ValueError as exc:
            raise ValueError(f"json_schema: not valid JSON: {exc}") from None
    try:
        return _parse(kind, text)
    except (RuntimeError, ValueError) as exc:
        message = _CPP_PREFIX.sub("", str(exc)).strip().splitlines()[0]
        raise ValueError(f"{kind}: invalid {kind.replace('_', ' ')}: {message}") from None


def canonical_ebnf(kind: str, text: str) -> str:
    """The constraint parsed, as EBNF: what the HTTP process sends the scheduler in place
    of the client's text, so the scheduler re-reads a grammar (linear) instead of parsing
    the schema again (cubic in its depth). ValueError naming the field if invalid."""
    return str(parse_grammar(kind, text))


# ---- checking a request's constraint -------------------------------------------------------
class Deferral:
    """Grammar checks a thread leaves to someone else: the HTTP process builds requests on
    its tokenizing threads and parses grammars on its own grammar thread
    (``server/grammar_check.py``). ``check_constraint`` on a thread inside ``deferring``
    checks only the limits (cheap) and answers from ``lookup`` (digest -> an error message,
    or "" when known valid, or None when unknown); unknown grammars land in ``pending``."""

    def __init__(self, limits: GrammarLimits, lookup: Callable[[bytes], str | None]) -> None:
        self.limits = limits
        self.lookup = lookup
        self.pending: dict[bytes, tuple[str, str]] = {}


_local = threading.local()


@contextlib.contextmanager
def deferring(deferral: Deferral) -> Iterator[Deferral]:
    _local.deferral = deferral
    try:
        yield deferral
    finally:
        _local.deferral = None


def check_constraint(params: SamplingParams) -> None:
    """Raise ValueError naming the field when the request's schema / regex / grammar is
    invalid (the HTTP layer makes it a 400). Inside ``deferring`` (the HTTP process) only
    the limits are checked here and the parse is left to the deferral's owner; elsewhere
    (the offline Engine, whose input is its caller's own) it is parsed now."""
    if params.constraint is None:
        return
    kind, text = params.constraint
    deferral: Deferral | None = getattr(_local, "deferral", None)
    if deferral is not None:
        check_limits(kind, text, deferral.limits)
        key = digest(kind, text)
        known = deferral.lookup(key)
        if known is None:
            deferral.pending[key] = (kind, text)
        elif known:
            raise ValueError(known)
        return
    key = digest(kind, text)
    with _checked_lock:
        if _checked.get(key):
            return
    parse_grammar(kind, text)
    with _checked_lock:
        _checked.put(key, True, 32)


# ---- caches --------------------------------------------------------------------------------
V = TypeVar("V")


class ByteLRU(Generic[V]):
    """Digest -> value, least recently used first out, bounded by the bytes its values take
    (as the caller measures them). A value larger than the whole bound is not kept. Not
    thread-safe: its owner locks."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.bytes = 0
        self._items: collections.OrderedDict[bytes, tuple[V, int]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: bytes) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: bytes, value: V, size: int) -> bool:
        """Keep ``value`` (evicting the least recently used); False when it is larger than
        the whole bound (then nothing is evicted for it)."""
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        if size > self.bound:
            return False
        while self._items and self.bytes + size > self.bound:
            _, (_, freed) = self._items.popitem(last=False)
            self.bytes -= freed
        self._items[key] = (value, size)
        self.bytes += size
        return True

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0


# Digests of the grammars the offline path parsed (check_constraint without a deferral).
_checked: ByteLRU[bool] = ByteLRU(CHECKED_ENTRIES * 32)
_checked_lock = threading.Lock()
