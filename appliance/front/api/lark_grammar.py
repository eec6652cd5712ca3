"""A Lark grammar (the `format` of an OpenAI custom tool, as Codex's apply_patch sends it) as the EBNF genai's
structured output compiles (xgrammar's dialect: `name ::= ...`, string literals, character classes, `( ) | * + ?`,
the start rule named `root`).

Lark itself reads the grammar (rules, `?rule` inlining, `+ ? * [ ]`, string literals, /regex/ terminals,
`%import common.X`, `-> alias`, templates) and compiles it to plain alternatives of symbols; each terminal's
regex is then written out as EBNF from Python's own regex parser. What has no EBNF form (`%ignore`, `%declare`,
lookaround, back-references, anchors, case-insensitive flags) is a GrammarNotConvertible naming the construct, for
a 400: never a silently unconstrained call. `%import` reaches lark's own grammars only, never the server's files.

Bounded by construction (issue 36): what a conversion writes is counted before it is written. The definition's
length and nesting are checked before lark reads it, its terminals' patterns (terminals used in terminals written
out in place) on lark's parse before lark resolves them, the alternatives lark would write out for each rule (every
`x?`, `[x]`, `(a|b)` and `x~n..m` multiplies them) before it compiles, and each regex's repeats written out (the
product of nested repeats: what genai's matcher grows to) before it is written; repeats are written as genai's own
`{m,n}`. A grammar past a limit is a GrammarTooLarge naming the limit, in milliseconds; one inside them converts
in time and memory proportional to the limits. The front runs the conversion in a helper process
(appliance.front.api.grammar_helper) with a time bound, never in its own threads.
"""

from __future__ import annotations

import re
import re._constants as sre  # the parsed-regex opcodes
import re._parser as sre_parse
from typing import Any, NamedTuple

MAX_DEFINITION_CHARS = 32 << 10  # a Lark definition: Codex's apply_patch grammar is 1.1 KB
MAX_EBNF_CHARS = 256 << 10  # what one conversion writes (all rules and terminals)
MAX_REGEX_ATOMS = 16 << 10  # a regex with its repeats written out; all of a grammar's terminals together
# Symbols of the rules lark's compile writes out: each `x?` doubles a rule's alternatives (16 of them: 2.3 s and
# 2.9 MB of lark, each two more x4). 10 optionals in one rule are 10,240 symbols, converted in a few ms.
MAX_RULE_SYMBOLS = 32 << 10
# Tree nodes the expansion count visits: a template's body is counted at each use, so templates using the next
# one many times would have the count itself walk width^depth nodes (a 785-byte grammar held the helper, and every
# other client's conversion, for its whole time bound). A grammar without templates visits at most about one node
# per character of its definition.
MAX_COUNT_STEPS = 2 * MAX_DEFINITION_CHARS
MAX_NESTING = 32  # ( [ { in a definition: lark's validation walks a nested expression once per level (300: 8 s)
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


class GrammarTooLarge(GrammarNotConvertible):
    """A grammar whose conversion would write more than a limit allows; the message names the limit."""


class Converted(NamedTuple):
    ebnf: str                   # "" when refused
    refusal: str | None = None  # why not
    code: str | None = None     # the error code of a refusal: TOO_LARGE past a limit, else None (invalid_request)


TOO_LARGE = "grammar_too_large"


def lark_to_ebnf(definition: str) -> str:
    """The EBNF of a Lark grammar whose start rule is `start`; GrammarNotConvertible naming what it cannot take."""
    result = converted(definition)
    if result.refusal is not None:
        raise (GrammarTooLarge if result.code == TOO_LARGE else GrammarNotConvertible)(result.refusal)
    return result.ebnf


def converted(definition: str) -> Converted:
    """The conversion, or the refusal. The front calls it through appliance.front.api.grammar_helper (in a
    helper process, remembering refusals and small results), never on its own threads."""
    try:
        return Converted(_convert(definition))
    except GrammarNotConvertible as exc:
        return refused(exc)


def refused(exc: GrammarNotConvertible) -> Converted:
    return Converted("", str(exc), TOO_LARGE if isinstance(exc, GrammarTooLarge) else None)


def check_definition(definition: str) -> None:
    """GrammarTooLarge for a definition longer than MAX_DEFINITION_CHARS: checked before anything reads it."""
    if len(definition) > MAX_DEFINITION_CHARS:
        raise GrammarTooLarge(f"the Lark grammar is {len(definition)} characters long; the limit is "
                              f"{MAX_DEFINITION_CHARS}")
    if nesting(definition) > MAX_NESTING:
        raise GrammarTooLarge(f"the Lark grammar nests ( [ {{ more than {MAX_NESTING} deep")


LARK_TOKENS = re.compile(r'"(?:[^"\\\n]|\\.)*"|//[^\n]*|/(?:[^/\\\n]|\\.)+/|[()\[\]{}]')


def nesting(definition: str) -> int:
    """How deep the grammar's brackets nest, outside string literals, regexes and comments (a regex's own groups
    are sre_parse's to count)."""
    depth = deepest = 0
    for token in LARK_TOKENS.findall(definition):
        if token in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in ")]}":
            depth -= 1
    return deepest


def _convert(definition: str) -> str:
    from lark.exceptions import LarkError
    from lark.load_grammar import load_grammar

    check_definition(definition)
    check_terminals(definition)
    try:
        grammar, _ = load_grammar(definition, "<tool grammar>", [_lark_library], False)
        check_expansion(grammar)
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
    atoms = 0
    for terminal in terminals:
        atoms += regex_atoms(terminal_regex(terminal.name, terminal.pattern)[0], f"terminal {terminal.name}")
        if atoms > MAX_REGEX_ATOMS:
            raise GrammarTooLarge(f"the Lark grammar's terminals are more than {MAX_REGEX_ATOMS} characters once "
                                  f"their repeats are written out (at terminal {terminal.name}: nested repeats "
                                  "multiply)")
        lines.append(f"{_name(terminal.name)} ::= {terminal_ebnf(terminal.name, terminal.pattern)}")
    ebnf = "\n".join(lines) + "\n"
    if len(ebnf) > MAX_EBNF_CHARS:
        raise GrammarTooLarge(f"the Lark grammar is more than {MAX_EBNF_CHARS} characters as EBNF")
    return ebnf


def check_expansion(grammar: Any) -> None:
    """GrammarTooLarge for a grammar whose compile would write out more than MAX_RULE_SYMBOLS symbols of rules:
    counted on lark's loaded grammar (trees of expansions, expansion, expr, maybe, value) before compile()."""
    templates = {name: (params, tree) for name, params, tree, _ in grammar.rule_defs if params}
    counter = _ExpansionCounter(templates)
    symbols = 0
    for name, params, tree, _ in grammar.rule_defs:
        if not params:
            alternatives, length = counter.count(tree, {})
            symbols += alternatives * max(length, 1)
        symbols += counter.extra
        counter.extra = 0
        if symbols > MAX_RULE_SYMBOLS:
            raise GrammarTooLarge(f"rule {name} of the Lark grammar expands into more than {MAX_RULE_SYMBOLS} "
                                  "symbols (each optional item, group of alternatives or ~ repeat multiplies the "
                                  "alternatives lark writes out)")


class _ExpansionCounter:
    """(alternatives, longest alternative) of a rule tree as lark's EBNF_to_BNF and SimplifyRule write it out:
    a sequence multiplies its items' alternatives, a choice adds them, `x?` and `[x]` add one, `x~n..m` is the
    alternatives x^n .. x^m; `x*` and `x+` are a new rule of two alternatives (counted in `extra`), and a
    template's use is a new rule, its body counted with the arguments in place. Counts saturate past the limit,
    so no count is a huge number."""

    CAP = MAX_RULE_SYMBOLS + 1

    def __init__(self, templates: dict[str, tuple]):
        self.templates = templates
        self.extra = 0  # symbols of the rules that x*, x+ and templates add
        self.depth = 0
        self.steps = 0  # nodes visited, uses of templates included: the count's own work is bounded too

    def count(self, tree: Any, env: dict[str, tuple[int, int]]) -> tuple[int, int]:
        from lark import Token, Tree

        self.steps += 1
        if self.steps > MAX_COUNT_STEPS:
            raise GrammarTooLarge(f"the Lark grammar's rules, with each use of a template written out, are more "
                                  f"than {MAX_COUNT_STEPS} items (templates using templates multiply)")
        if not isinstance(tree, Tree):  # a symbol, or a token (an operator, a number)
            return env.get(getattr(tree, "name", None), (1, 1)) if not isinstance(tree, Token) else (1, 0)
        kind, children = tree.data, [c for c in tree.children if not isinstance(c, Token) or tree.data == "expr"]
        if kind == "expansions":
            counts = [self.count(c, env) for c in children]
            return self._cap(sum(a for a, _ in counts)), max((n for _, n in counts), default=0)
        if kind == "expansion":
            alternatives, length = 1, 0
            for child in children:
                a, n = self.count(child, env)
                alternatives, length = self._cap(alternatives * a), length + n
            return alternatives, length
        if kind == "maybe":
            a, n = self.count(children[0], env)
            return self._cap(a + 1), n
        if kind == "expr":
            return self._expr(children, env)
        if kind == "alias":
            return self.count(children[0], env)
        if kind == "template_usage":
            return self._template(children, env)
        if kind == "value":
            return self.count(children[0], env)
        return 1, 1  # literal, range, a name

    def _expr(self, children: list, env: dict) -> tuple[int, int]:
        a, n = self.count(children[0], env)
        op = str(children[1])
        if op == "?":
            return self._cap(a + 1), n
        if op in ("*", "+"):
            self._add_extra(2 * a * (n + 1))
            return (2, 1) if op == "*" else (1, 1)
        low = int(children[2])
        high = int(children[3]) if len(children) > 3 else low
        if high >= self.CAP:
            return self.CAP, high * n
        alternatives = 0
        for k in range(low, high + 1):
            alternatives = self._cap(alternatives + self._cap(a ** min(k, 64)))
        return alternatives, high * n

    def _template(self, children: list, env: dict) -> tuple[int, int]:
        name = getattr(children[0], "name", "")
        params, body = self.templates.get(name, ((), None))
        if body is None:
            return 1, 1
        self.depth += 1
        if self.depth > 8:
            raise GrammarTooLarge("the Lark grammar's templates nest more than 8 deep")
        inner = {param: self.count(arg, env) for param, arg in zip(params, children[1:])}
        a, n = self.count(body, inner)
        self.depth -= 1
        self._add_extra(a * max(n, 1))
        return 1, 1

    def _add_extra(self, symbols: int) -> None:
        """Symbols of a rule x*, x+ or a template's use adds; past the limit the grammar is refused now (the
        rule's own count would refuse it after all its uses were walked)."""
        self.extra = self._cap(self.extra + symbols)
        if self.extra >= self.CAP:
            raise GrammarTooLarge(f"the Lark grammar's rules expand into more than {MAX_RULE_SYMBOLS} symbols "
                                  "(each use of a template, x* and x+ adds a rule)")

    def _cap(self, n: int) -> int:
        return min(n, self.CAP)


def check_terminals(definition: str) -> None:
    """GrammarTooLarge for terminals whose patterns, with the terminals they use written out in place, pass
    MAX_EBNF_CHARS: counted on lark's parse of the definition, before lark resolves the references (lark's own
    resolution walks every use: 14 terminals each using the next twice took it 10 s)."""
    from lark import Token, Tree
    from lark.exceptions import LarkError
    from lark.grammar import Terminal
    from lark.load_grammar import _parse_grammar

    try:
        statements = _parse_grammar(definition, "<tool grammar>").children
    except LarkError as exc:
        raise GrammarNotConvertible(f"the Lark grammar does not load: {_first_line(exc)}") from None
    except RecursionError:
        raise GrammarNotConvertible("the Lark grammar nests too deeply") from None
    terms = {str(stmt.children[0]): stmt.children[-1] for stmt in statements if stmt.data == "term"}
    sizes: dict[str, int] = {}

    def size(tree: Any) -> int:
        if isinstance(tree, Tree):
            return min(sum(size(child) for child in tree.children) + 8, MAX_EBNF_CHARS + 1)
        name = getattr(tree, "name", None)
        if name in terms and not isinstance(tree, Token):
            if name not in sizes:
                sizes[name] = len(name)  # while it is counted: a terminal using itself is lark's error to name
                sizes[name] = size(terms[name])
            return sizes[name]
        return len(str(tree)) + 8

    for name in terms:
        try:
            too_large = size(Terminal(name)) > MAX_EBNF_CHARS
        except RecursionError:
            raise GrammarNotConvertible("the Lark grammar's terminals nest too deeply") from None
        if too_large:
            raise GrammarTooLarge(f"terminal {name} of the Lark grammar is more than {MAX_EBNF_CHARS} characters "
                                  "once the terminals it uses are written out")


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
    regex, dotall = terminal_regex(name, pattern)
    if pattern.type == "str":
        return string_literal(pattern.value)
    return regex_ebnf(regex, dotall=dotall, where=f"terminal {name}")


def terminal_regex(name: str, pattern: Any) -> tuple[str, bool]:
    """A terminal's pattern as (regex, dotall)."""
    if pattern.type == "str":
        if "i" in pattern.flags:
            raise GrammarNotConvertible(f"terminal {name}: case-insensitive strings (\"...\"i) are not supported")
        return re.escape(pattern.value), False
    if set(pattern.flags) - {"s"}:
        raise GrammarNotConvertible(f"terminal {name}: regex flags {''.join(sorted(pattern.flags))} are not "
                                    "supported (only s)")
    return pattern.value, "s" in pattern.flags


def parse_regex(regex: str, where: str = "regex") -> Any:
    try:
        return sre_parse.parse(regex)
    except (re.error, RecursionError, OverflowError) as exc:
        raise GrammarNotConvertible(f"{where}: /{_shown(regex)}/ is not a valid regex ({exc})") from None


def regex_atoms(regex: str, where: str = "regex") -> int:
    """How many characters, classes and literals `regex` is once its repeats are written out (nested repeats
    multiply): the size of what genai builds to match it (a regex of 27,000 took it 0.8 s, of 1,000,000 30 s),
    counted on Python's parse of it, never written out. GrammarNotConvertible if it is no valid regex;
    saturates just past MAX_REGEX_ATOMS."""
    return _atoms(list(parse_regex(regex, where)))


_ATOMS_CAP = MAX_REGEX_ATOMS + 1


def _atoms(items: list) -> int:
    return min(sum(_item_atoms(op, arg) for op, arg in items), _ATOMS_CAP)


def _item_atoms(op, arg) -> int:
    if op is sre.BRANCH:
        return min(sum(_atoms(list(alt)) for alt in arg[1]), _ATOMS_CAP)
    if op is sre.SUBPATTERN:
        return _atoms(list(arg[3]))
    if op is sre.ATOMIC_GROUP:
        return _atoms(list(arg))
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
        low, high, sub = arg
        copies = max(low + 1 if high == sre.MAXREPEAT else high, 1)
        return min(_atoms(list(sub)) * copies, _ATOMS_CAP)
    if op is sre.IN:  # a class is as large as its ranges for genai: 3,000 of them in {8} compiled for 9.6 s
        return max(len(arg), 1)
    return 1  # a literal, any character, a refused construct


def regex_ebnf(regex: str, dotall: bool = False, where: str = "regex") -> str:
    """A regular expression as an EBNF expression (repeats as EBNF repeats, {m,n}: genai compiles 64 copies of
    `[a-z]?` in 0.4 s, `[a-z]{0,64}` in 0.04 s); GrammarTooLarge past MAX_REGEX_ATOMS, before writing it."""
    parsed = parse_regex(regex, where)
    if _atoms(list(parsed)) > MAX_REGEX_ATOMS:
        raise GrammarTooLarge(f"{where}: the regex /{_shown(regex)}/ is more than {MAX_REGEX_ATOMS} characters "
                              "once its repeats are written out (nested {m,n} repeats multiply)")
    if parsed.state.flags & re.IGNORECASE:
        raise GrammarNotConvertible(f"{where} /{_shown(regex)}/: case-insensitive regexes ((?i)) are not supported")
    if parsed.state.flags & re.DOTALL:
        dotall = True
    return _sequence(list(parsed), dotall, f"{where} /{_shown(regex)}/")


def _shown(regex: str) -> str:
    """A regex as an error message quotes it: a long one is cut (its message must stay small)."""
    return regex if len(regex) <= 200 else regex[:200] + "..."


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
    if body.endswith(("*", "+", "?", "}")):  # (x+)? stays grouped: EBNF operators do not stack
        body = f"({body})"
    if high == sre.MAXREPEAT:
        return body + {0: "*", 1: "+"}.get(low, f"{{{low},}}")
    if (low, high) == (0, 1):
        return body + "?"
    if high == 0:
        return '""'
    return body + (f"{{{low}}}" if low == high else f"{{{low},{high}}}")


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
