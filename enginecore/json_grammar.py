"""JSON grammars that cannot run away: bounded number literals and bounded whitespace.

xgrammar's JSON grammars (from a schema, and its builtin any-JSON grammar) let a number have any
number of digits and, in the builtin grammar, any run of whitespace: a weak model at temperature 0
can write `1111…` or blank lines until max_tokens and never close the JSON. The EBNF they print is
rewritten here:

- a number literal has at most MAX_SIGNIFICANT_DIGITS digits in its integer and fraction parts
  together (a leading "0." does not count; no double holds more than 17 significant digits) and an
  exponent of at most MAX_EXPONENT_DIGITS digits; every other run of digits in the grammar (the
  range rules xgrammar writes for minimum / maximum) is bounded the same way;
- whitespace between tokens is at most two spaces or tabs, or one newline followed by at most
  MAX_INDENT spaces or tabs: enough for pretty-printed JSON, nothing to pad with;
- a string's characters exclude the control characters (JSON escapes them) and the UTF-16
  surrogates (no valid UTF-8 encodes them): xgrammar's length-bounded strings (maxLength) allow both,
  so a weak model could write raw control bytes json.loads refuses, or a surrogate's three bytes
  that decode to three replacement characters where the grammar counted one.

`bound_numbers=False` (the server's --no-json-number-bound) keeps xgrammar's number rules and
bounds only the whitespace. Each rewrite is checked to have happened, so an xgrammar release that
prints other rule shapes fails loudly (tests/unit/test_json_grammar.py) instead of silently
leaving numbers unbounded.
"""

from __future__ import annotations

import re

MAX_SIGNIFICANT_DIGITS = 17
MAX_EXPONENT_DIGITS = 3
MAX_INDENT = 32
WS_RULE = "tern_ws"

_RULE = re.compile(r"^(\w+) ::= (.*)$", re.M)
_DIGIT_RULE_BODIES = ("(([0-9]))", "([0-9])")
_WHITESPACE_REPEAT = re.compile(r"\bwhitespace(?:_\d+)?\{0, \d+\}")
_LOOSE_WHITESPACE = "[ \\n\\r\\t]*"
_NEGATED_CLASS = re.compile(r"\[\^((?:\\.|[^\]\\])*)\]")
_CONTROL = "\\0-\\x1f"
_SURROGATES = "\\uD800-\\uDFFF"


def number_rules(name: str) -> str:
    """EBNF for `name` (a JSON number) and `name`_int (a JSON integer), bounded as above."""
    n = MAX_SIGNIFICANT_DIGITS
    # k digits before the point (the first non-zero), then at most n - k after it.
    parts = ['"0" ("." [0-9]{1,' + str(n) + "})?"]
    for k in range(1, n + 1):
        rest = f"[0-9]{{{k - 1}}}" if k > 1 else ""
        frac = f' ("." [0-9]{{1,{n - k}}})?' if k < n else ""
        parts.append(f"[1-9] {rest}{frac}".replace("  ", " "))
    exponent = f"([eE] [+\\-]? [0-9]{{1,{MAX_EXPONENT_DIGITS}}})?"
    return (
        f'{name} ::= "-"? {name}_body {exponent}\n'
        f"{name}_body ::= " + " | ".join(f"({p})" for p in parts) + "\n"
        f'{name}_int ::= "-"? ("0" | [1-9] [0-9]{{0,{n - 1}}})\n'
    )


def whitespace_rule(any_whitespace: bool = True) -> str:
    if not any_whitespace:  # vLLM's disable_any_whitespace: the compact form
        return f'{WS_RULE} ::= ""\n'
    return f'{WS_RULE} ::= [ \\t]{{0,2}} | ("\\r"? "\\n" [ \\t]{{0,{MAX_INDENT}}})\n'


def bound_schema_grammar(ebnf: str, bound_numbers: bool) -> str:
    """xgrammar's grammar of a JSON schema (from_json_schema), bounded. (Without any_whitespace
    xgrammar's grammar has no whitespace rules; the numbers are bounded all the same.)"""
    out = _valid_string_characters(_bound_whitespace(ebnf))
    if bound_numbers:
        out = _bound_digit_runs(out)
        out = _replace_rule(out, "basic_number", "tern_number")
        out = _replace_rule(out, "basic_integer", "tern_number_int")
        out += number_rules("tern_number")
    return out + whitespace_rule()


def bound_any_json_grammar(ebnf: str, bound_numbers: bool, any_whitespace: bool = True) -> str:
    """xgrammar's builtin any-JSON grammar (json_object), bounded."""
    if _LOOSE_WHITESPACE not in ebnf:
        raise ValueError("xgrammar's JSON grammar has no [ \\n\\r\\t]* whitespace to bound")
    out = _valid_string_characters(ebnf.replace(_LOOSE_WHITESPACE, WS_RULE))
    if bound_numbers:
        out = _bound_builtin_numbers(out)
    return out + whitespace_rule(any_whitespace)


def _valid_string_characters(ebnf: str) -> str:
    """Every negated character class (a JSON string's characters) also excludes the control
    characters and the surrogates."""

    def exclude(match: re.Match) -> str:
        body = match[1]
        if _CONTROL not in body:
            body = _CONTROL + body
        return f"[^{body}{_SURROGATES}]"

    out, count = _NEGATED_CLASS.subn(exclude, ebnf)
    if count == 0 and "string" in ebnf:
        raise ValueError("xgrammar's string rules changed shape: cannot bound their characters")
    return out


def _bound_whitespace(ebnf: str) -> str:
    out = _WHITESPACE_REPEAT.sub(WS_RULE, ebnf).replace(_LOOSE_WHITESPACE, WS_RULE)
    bodies = [m[2] for m in _RULE.finditer(out)]
    if any(re.search(r"\bwhitespace\w*", body) for body in bodies):
        raise ValueError("xgrammar's whitespace rules changed shape: cannot bound them")
    return out


def _bound_digit_runs(ebnf: str) -> str:
    """Every unbounded repetition of a digit (rules whose body is [0-9], or [0-9]* inline)."""
    n = MAX_SIGNIFICANT_DIGITS
    digit_rules = [m[1] for m in _RULE.finditer(ebnf) if m[2].strip() in _DIGIT_RULE_BODIES]
    for name in digit_rules:
        ebnf = re.sub(rf"\b{name}\{{(\d+), -1\}}", rf"{name}{{\1, {n}}}", ebnf)
    return ebnf.replace("[0-9]*", f"[0-9]{{0, {n - 1}}}")


def _replace_rule(ebnf: str, name: str, replacement: str) -> str:
    """Uses of rule `name` become `replacement`; its definition stays (unused is harmless)."""
    uses = re.compile(rf"(?<![\w]){name}(?![\w])")
    lines = []
    for line in ebnf.splitlines():
        head, sep, body = line.partition(" ::= ")
        lines.append(head + sep + uses.sub(replacement, body) if sep else line)
    return "\n".join(lines) + "\n"


def _bound_builtin_numbers(ebnf: str) -> str:
    """The builtin grammar writes numbers inline: '("0" fraction exponent) | ([1-9] [0-9]*
    fraction exponent) | ("-" ...)'; every such alternative becomes the bounded number rule."""
    out = ebnf
    for shape, bounded in _BUILTIN_NUMBERS:
        out, count = re.subn(shape, bounded, out)
        if count == 0:
            raise ValueError("xgrammar's JSON grammar changed shape: cannot bound its numbers")
    exponent = f"tern_number_exp ::= ([eE] [+\\-]? [0-9]{{1,{MAX_EXPONENT_DIGITS}}})?\n"
    return out + number_rules("tern_number") + exponent


# The builtin grammar's inline number alternatives -> the bounded rules.
_BUILTIN_NUMBERS = (
    (
        r'\("-" (?:"0"|\[0-9\]|\[1-9\] \[0-9\]\*) fraction exponent',
        '("-" tern_number_body tern_number_exp',
    ),
    (r'\("0" fraction exponent', "(tern_number_body tern_number_exp"),
    (r"\(\[1-9\] \[0-9\]\* fraction exponent", "(tern_number_body tern_number_exp"),
)
