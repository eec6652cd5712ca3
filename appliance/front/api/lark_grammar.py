"""A Lark grammar (the `format` of an OpenAI custom tool, as Codex's apply_patch sends it) as the EBNF genai's
structured output compiles (xgrammar's dialect: `name ::= ...`, string literals, character classes, `( ) | * + ?`,
the start rule named `root`).

Lark itself reads the grammar (rules, `?rule` inlining, `+ ? * [ ]`, string literals, /regex/ terminals,
`%import common.X`, `-> alias`, templates) and compiles it to plain alternatives of symbols; each terminal's
regex is then written out as EBNF from Python's own regex parser. What has no EBNF form (`%ignore`, `%declare`,
lookaround, back-references, anchors, case-insensitive flags) is a GrammarNotConvertible naming the construct, for
a 400: never a silently unconstrained call. `%import` reaches lark's own grammars only, never the server's files.
"""

from __future__ import annotations

import asyncio
import functools
import re
import re._constants as sre  # the parsed-regex opcodes
import re._parser as sre_parse
from typing import Any

MAX_EXPANDED_REPEAT = 64  # {m,n} is written out as copies: a bound past this is refused, not compiled for minutes
START = "start"
WHITESPACE = " \t\n\r\f\v"
DIGITS = [("0", "9")]
WORD = [("a", "z"), ("A", "Z"), ("0", "9"), ("_", "_")]
CATEGORIES = {sre.CATEGORY_DIGIT: (DIGITS, False), sre.CATEGORY_NOT_DIGIT: (DIGITS, True),
              sre.CATEGORY_WORD: (WORD, False), sre.CATEGORY_NOT_WORD: (WORD, True),
              sre.CATEGORY_SPACE: ([(c, c) for c in WHITESPACE], False),
              sre.CATEGORY_NOT_SPACE: ([(c, c) for c in WHITESPACE], True)}


class GrammarNotConvertible(ValueError):
    """A grammar with a construct genai's EBNF cannot express; the message names it."""


def lark_to_ebnf(definition: str) -> str:
    """The EBNF of a Lark grammar whose start rule is `start`; GrammarNotConvertible naming what it cannot take."""
    ebnf, refusal = converted(definition)
    if refusal is not None:
        raise GrammarNotConvertible(refusal)
    return ebnf


async def convert_off_loop(definitions: list[str]) -> None:
    """Convert (and remember) grammars in a thread, so that lark_to_ebnf finds them converted: lark takes about
    70 ms to read Codex's grammar and seconds for a large one, time the front's event loop must not stop for."""
    for definition in definitions:
        await asyncio.to_thread(converted, definition)


@functools.lru_cache(maxsize=64)
def converted(definition: str) -> tuple[str, str | None]:
    """(EBNF, None), or ("", why not): refusals are remembered as conversions are (Codex sends the same grammar
    every turn)."""
    try:
        return _convert(definition), None
    except GrammarNotConvertible as exc:
        return "", str(exc)


def _convert(definition: str) -> str:
    from lark.exceptions import LarkError
    from lark.load_grammar import load_grammar

    try:
        grammar, _ = load_grammar(definition, "<tool grammar>", [_lark_library], False)
        terminals, rules, ignore = grammar.compile([START], set())
    except LarkError as exc:
        raise GrammarNotConvertible(f"the Lark grammar does not load: {_first_line(exc)}") from None
    except RecursionError:
        raise GrammarNotConvertible("the Lark grammar nests too deeply") from None
    if not any(rule.origin.name == START for rule in rules):
        raise GrammarNotConvertible(f"the Lark grammar has no '{START}' rule (where a tool's input begins)")
    if ignore:
        raise GrammarNotConvertible(f"%ignore ({', '.join(ignore)}) has no EBNF form: the grammar must spell out "
                                    "where whitespace goes")
    defined = {terminal.name for terminal in terminals}
    declared = sorted({s.name for rule in rules for s in rule.expansion if s.is_term and s.name not in defined})
    if declared:
        raise GrammarNotConvertible(f"%declare ({', '.join(declared)}) has no EBNF form: a terminal the grammar "
                                    "does not define cannot be generated")
    lines = [f"root ::= {_name(START)}"]
    alternatives: dict[str, list[str]] = {}
    for rule in rules:
        body = " ".join(_name(symbol.name) for symbol in rule.expansion) or '""'
        alternatives.setdefault(rule.origin.name, []).append(body)
    lines += [f"{_name(origin)} ::= {' | '.join(bodies)}" for origin, bodies in alternatives.items()]
    for terminal in terminals:
        lines.append(f"{_name(terminal.name)} ::= {terminal_ebnf(terminal.name, terminal.pattern)}")
    return "\n".join(lines) + "\n"


def _lark_library(base_path: Any, grammar_path: str) -> tuple[Any, str]:
    """Lark's import loader for a client's grammar: lark's own grammars (common.lark and the like) only. Lark would
    otherwise look for `%import foo.X` in the server's working directory (reading its files, or a 500 where
    there are none)."""
    from lark.load_grammar import PackageResource, stdlib_loader

    try:
        return stdlib_loader(base_path if isinstance(base_path, PackageResource) else None, grammar_path)
    except OSError:
        raise GrammarNotConvertible(f"%import of {grammar_path.removesuffix('.lark').replace('/', '.')}: only "
                                    "lark's own grammars (common) can be imported") from None


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _name(symbol: str) -> str:
    """Lark's names prefixed so none is `root` or clashes (xgrammar identifiers are letters, digits, '_', '-' and
    '.'): the grammar's rules (lower case, `_rule` too) r_, its terminals (upper case, `_TERM` too) t_, and the
    ones lark makes up (__ANON_0, __start_plus_0: names a grammar cannot write) g_. Stripping underscores made a
    grammar's own `_start_plus_0` or `ANON_0` the same symbol as lark's."""
    if symbol.startswith("__"):
        return "g_" + symbol[2:]
    return ("r_" if symbol.lstrip("_")[:1].islower() else "t_") + symbol


def terminal_ebnf(name: str, pattern: Any) -> str:
    if pattern.type == "str":
        if "i" in pattern.flags:
            raise GrammarNotConvertible(f"terminal {name}: case-insensitive strings (\"...\"i) are not supported")
        return string_literal(pattern.value)
    if set(pattern.flags) - {"s"}:
        raise GrammarNotConvertible(f"terminal {name}: regex flags {''.join(sorted(pattern.flags))} are not "
                                    "supported (only s)")
    return regex_ebnf(pattern.value, dotall="s" in pattern.flags, where=f"terminal {name}")


def regex_ebnf(regex: str, dotall: bool = False, where: str = "regex") -> str:
    """A regular expression as an EBNF expression."""
    try:
        parsed = sre_parse.parse(regex)
    except (re.error, RecursionError) as exc:
        raise GrammarNotConvertible(f"{where}: /{regex}/ is not a valid regex ({exc})") from None
    if parsed.state.flags & re.IGNORECASE:
        raise GrammarNotConvertible(f"{where} /{regex}/: case-insensitive regexes ((?i)) are not supported")
    if parsed.state.flags & re.DOTALL:
        dotall = True
    return _sequence(list(parsed), dotall, f"{where} /{regex}/")


def _sequence(items: list, dotall: bool, where: str) -> str:
    parts = [_item(op, arg, dotall, where) for op, arg in items]
    return "(" + " ".join(parts) + ")" if len(parts) > 1 else (parts[0] if parts else '""')


def _item(op, arg, dotall: bool, where: str) -> str:
    if op is sre.LITERAL:
        return string_literal(chr(arg))
    if op is sre.NOT_LITERAL:
        return char_class([(chr(arg), chr(arg))], negated=True)
    if op is sre.ANY:
        return char_class([], negated=True) if dotall else char_class([("\n", "\n")], negated=True)
    if op is sre.IN:
        return _in(arg, where)
    if op is sre.BRANCH:
        return "(" + " | ".join(_sequence(list(alt), dotall, where) for alt in arg[1]) + ")"
    if op is sre.SUBPATTERN:
        _group, add_flags, _del_flags, sub = arg
        if add_flags & re.IGNORECASE:
            raise GrammarNotConvertible(f"{where}: case-insensitive groups are not supported")
        return _sequence(list(sub), dotall or bool(add_flags & re.DOTALL), where)
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
        low, high, sub = arg
        return _repeat(_sequence(list(sub), dotall, where), low, high, where)
    if op is sre.ATOMIC_GROUP:
        return _sequence(list(arg), dotall, where)
    names = {sre.AT: "anchors (^, $, \\b)", sre.ASSERT: "lookahead and lookbehind",
             sre.ASSERT_NOT: "negative lookahead and lookbehind", sre.GROUPREF: "back-references",
             sre.GROUPREF_EXISTS: "conditional groups"}
    raise GrammarNotConvertible(f"{where}: {names.get(op, str(op).lower())} have no EBNF form")


def _repeat(body: str, low: int, high: int, where: str) -> str:
    if body.endswith(("*", "+", "?")):  # (x+)? stays grouped: EBNF operators do not stack
        body = f"({body})"
    if high == sre.MAXREPEAT:
        if low == 0:
            return body + "*"
        if low == 1:
            return body + "+"
        if low > MAX_EXPANDED_REPEAT:
            raise GrammarNotConvertible(f"{where}: repeat counts above {MAX_EXPANDED_REPEAT} are not supported")
        return "(" + " ".join([body] * low) + " " + body + "*)"
    if high > MAX_EXPANDED_REPEAT:
        raise GrammarNotConvertible(f"{where}: repeat counts above {MAX_EXPANDED_REPEAT} are not supported")
    if (low, high) == (0, 1):
        return body + "?"
    return "(" + " ".join([body] * low + [body + "?"] * (high - low)) + ")" if high else '""'


def _in(items: list, where: str) -> str:
    ranges: list[tuple[str, str]] = []
    negated = False
    for op, arg in items:
        if op is sre.NEGATE:
            negated = True
        elif op is sre.LITERAL:
            ranges.append((chr(arg), chr(arg)))
        elif op is sre.RANGE:
            ranges.append((chr(arg[0]), chr(arg[1])))
        elif op is sre.CATEGORY:
            members, inverse = CATEGORIES[arg]
            if inverse and len(items) > 1 + negated:
                raise GrammarNotConvertible(f"{where}: \\D, \\W or \\S inside a larger character class is not "
                                            "supported")
            if inverse:
                negated = not negated
            ranges += members
        else:
            raise GrammarNotConvertible(f"{where}: {str(op).lower()} in a character class is not supported")
    return char_class(ranges, negated)


def char_class(ranges: list[tuple[str, str]], negated: bool = False) -> str:
    if not ranges and negated:
        return "[\\u0000-\\U0010ffff]"  # any character (xgrammar has no bare "."; an empty [^] class is refused)
    body = "".join(_class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}" for a, b in ranges)
    return f"[{'^' if negated else ''}{body}]"


ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escape(char: str, specials: str) -> str:
    if char in ESCAPES:
        return ESCAPES[char]
    if char in specials:
        return "\\" + char
    if not char.isprintable() or char.isspace() and char != " ":
        code = ord(char)
        return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
    return char


def _class_char(char: str) -> str:
    return _escape(char, "]-^[")


def string_literal(value: str) -> str:
    return '"' + "".join(_escape(c, '"') for c in value) + '"'
