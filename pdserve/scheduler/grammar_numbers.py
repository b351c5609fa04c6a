"""Bounded number literals in the grammars compiled from JSON schemas.

xgrammar writes a JSON number as `-? (0 | [1-9] [0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`:
every digit run is unbounded, and a small model that starts a run of digits may never
leave it (`{"x": -42444444444...` until max_tokens: no JSON at all). Interoperable JSON
(RFC 8259 section 6) is what a double or a 64-bit integer holds, so the grammars the
server compiles from a ``json_schema`` (``response_format``, ``tool_choice``, SGLang's
``json_schema``) bound them there:

- an integer (``"type": "integer"``): at most 19 digits;
- a number (``"type": "number"``, and any number in an untyped value, a ``json_object``):
  at most 17 significant digits (what tells one double from the next), then an optional
  exponent of at most 3 digits, up to 308; ``0.`` takes at most 17 fraction digits;
- the open end of a range (``minimum`` without ``maximum``, or the reverse; xgrammar writes
  ranges in plain decimal with at most 6 fraction digits): at most 19 integer digits.

The bounds are applied to xgrammar's EBNF text (the same text the HTTP process sends the
scheduler, ``grammar_text.canonical_ebnf``): its two number templates, whatever rule
prefix it gave them, are replaced by bounded rules; any other unbounded run of digits
outside string literals (a range's open end) is capped. String ``pattern``s stay
untouched: xgrammar prints them as ``Regex("...")`` literals, which are skipped.
"""

from __future__ import annotations

import re

# The digits a 64-bit integer has at most (9223372036854775807), and a double's
# significant digits (17 tell any two apart); its decimal exponent stays within 308.
INTEGER_DIGITS = 19
SIGNIFICANT_DIGITS = 17

_PREFIX = "pdserve_json"
INTEGER_RULE, NUMBER_RULE = f"{_PREFIX}_integer", f"{_PREFIX}_number"


def _number_rules() -> dict[str, str]:
    """The bounded rules, EBNF by name: integers, and numbers whose significand has k
    integer digits (1 to 17) and at most 17 - k fraction digits, or is 0.ddd."""
    significand = [f'("0" ("." [0-9]{{1,{SIGNIFICANT_DIGITS}}})?)']
    for k in range(1, SIGNIFICANT_DIGITS + 1):
        integer = "[1-9]" + (f" [0-9]{{{k - 1}}}" if k > 1 else "")
        fraction = f' ("." [0-9]{{1,{SIGNIFICANT_DIGITS - k}}})?' if k < SIGNIFICANT_DIGITS else ""
        significand.append(f"({integer}{fraction})")
    return {
        INTEGER_RULE: f'"0" | ("-"? [1-9] [0-9]{{0,{INTEGER_DIGITS - 1}}})',
        NUMBER_RULE: f'"-"? {_PREFIX}_significand ([eE] [+\\-]? {_PREFIX}_exponent)?',
        f"{_PREFIX}_significand": " | ".join(significand),
        # 0 to 308 (leading zeros allowed, as JSON allows them there), in 3 digits at most.
        f"{_PREFIX}_exponent": '[0-9]{1,2} | ([0-2] [0-9]{2}) | ("3" "0" [0-8])',
    }


_RULE_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")
_DIGIT_RULE_BODY = "(([0-9]))"
# xgrammar's templates (grammar_functor / json_schema_converter), for a rule P: the number
# P ::= ((P_1 P_2 P_3 P_5)) with P_2 the integer part (("0") | ([1-9] [0-9]*)); the
# integer P ::= (("0") | (P_1 [1-9] [0-9]*)).
_NUMBER_BODY = re.compile(r"^\(\((?P<p>[A-Za-z_][A-Za-z0-9_]*)_1 (?P=p)_2 (?P=p)_3 (?P=p)_5\)\)$")
_NUMBER_INTEGER_PART = '(("0") | ([1-9] [0-9]*))'
_INTEGER_BODY = re.compile(r'^\(\("0"\) \| \((?P<p>[A-Za-z_][A-Za-z0-9_]*)_1 \[1-9\] \[0-9\]\*\)\)$')
# One thing of a rule body: a string literal (skipped), a digit item with an unbounded
# repetition (capped), or another character class (skipped, so that a "[0-9]" inside it
# is never taken for one). The digit rules' names are filled in per grammar.
_BODY_TOKENS = (r'(?P<string>"(?:\\.|[^"\\])*")'
                r"|(?P<digit>\[0-9\]{names})\s*(?P<rep>\*|\+|\{{\s*(?P<min>\d+)\s*,\s*-1\s*\}})"
                r"|(?P<cls>\[(?:\\.|[^\]\\])*\])")


def _digit_runs(names: list[str]) -> re.Pattern[str]:
    alternatives = "".join(f"|\\b{re.escape(n)}\\b" for n in names)
    return re.compile(_BODY_TOKENS.format(names=alternatives))


def _cap(match: re.Match[str]) -> str:
    if match.group("rep") is None:
        return match.group(0)  # a string literal or another character class: as it is
    low = 1 if match.group("rep") == "+" else int(match.group("min") or 0)
    return f"{match.group('digit')}{{{low}, {max(low, INTEGER_DIGITS - 1)}}}"


def unbounded_digit_runs(ebnf: str) -> list[str]:
    """The rules of ``ebnf`` (xgrammar's printed form) that still repeat a digit without a
    bound, outside string literals: empty once ``bound_numbers`` has run."""
    rules = _parse_rules(ebnf)
    runs = _digit_runs([n for n, body in rules.items() if body == _DIGIT_RULE_BODY])
    return [name for name, body in rules.items() if any(m.group("rep") for m in runs.finditer(body))]


def _parse_rules(ebnf: str) -> dict[str, str]:
    rules: dict[str, str] = {}
    for line in ebnf.splitlines():
        if not line.strip():
            continue
        m = _RULE_LINE.match(line)
        if m is None:
            raise ValueError(f"json_schema: unexpected grammar line from the schema compiler: {line[:200]!r}")
        rules[m.group(1)] = m.group(2)
    return rules


def bound_numbers(ebnf: str) -> str:
    """``ebnf`` (xgrammar's grammar of a JSON schema, printed) with its number literals
    bounded as the module docstring says; unchanged when it has no numbers."""
    rules = _parse_rules(ebnf)
    digit_rules = [n for n, body in rules.items() if body == _DIGIT_RULE_BODY]
    runs = _digit_runs(digit_rules)
    used = False
    out: dict[str, str] = {}
    for name, body in rules.items():
        number, integer = _NUMBER_BODY.match(body), _INTEGER_BODY.match(body)
        if number is not None and rules.get(f"{number.group('p')}_2") == _NUMBER_INTEGER_PART:
            out[name], used = f"(({NUMBER_RULE}))", True
        elif integer is not None:
            out[name], used = f"(({INTEGER_RULE}))", True
        else:
            out[name] = runs.sub(_cap, body)
    if used:
        for name, body in _number_rules().items():
            if name in rules:  # (xgrammar's names are root*, basic_*, defs_*: never ours)
                raise ValueError(f"json_schema: the grammar already has a rule named {name!r}")
            out[name] = body
    return "".join(f"{name} ::= {body}\n" for name, body in out.items())
