"""What a request's constraints make its worker compile, counted in the front before they are sent (issue 36):
a regex (structured_outputs.regex, a custom tool's regex format, a schema's `pattern`) by the EBNF its nested
repeats write out, a JSON schema by its size with every `$ref` written out in place. genai compiles a constraint
in the worker, where one that takes long (a regex of three nested {100} repeats: 30 s) is taken for a hung
pipeline; past these limits a constraint is a 400 naming the limit, before any work is done.
"""

from __future__ import annotations

import json
import re
from typing import Any

from appliance.front.api import lark_grammar
from appliance.front.api.errors import InvalidRequest
from appliance.front.request import RequestFailed

TOO_LARGE = lark_grammar.TOO_LARGE  # the error code of a constraint past a limit
MAX_SCHEMA_CHARS = 1 << 20  # a JSON schema written out: every $ref in place, every pattern's repeats
REF_CYCLE_CHARS = 16  # a $ref to a schema it is inside: a recursive rule, written once
# A JSON pointer's array index (RFC 6901): ASCII digits, no leading zero. str.isdigit() also takes "²" (which int()
# refuses: a ValueError, a 500) and "١" (which int() reads as 1).
POINTER_INDEX = re.compile(r"0|[1-9][0-9]*", re.ASCII)
# No tokenizer's tokens average more characters over a prompt: a prompt longer than the model's context times
# this cannot fit, and is refused without the worker rendering and tokenizing it (a 900 KB message held the demo
# model's worker for a second; sixteen clients sending it held an honest client's request for three).
MAX_CHARS_PER_TOKEN = 64


def bounded_regex(regex: str, where: str) -> str:
    """The regex, if written out (lark_grammar.regex_atoms) it stays within lark_grammar.MAX_REGEX_ATOMS; else a
    400 naming `where`. A regex Python cannot parse is left to genai to judge (its dialect is not Python's)."""
    if regex_size(regex) > lark_grammar.MAX_REGEX_ATOMS:
        raise InvalidRequest(f"'{where}': the regex is more than {lark_grammar.MAX_REGEX_ATOMS} characters once "
                             "its repeats are written out (nested {m,n} repeats multiply)", where, TOO_LARGE)
    return regex


EBNF_RULE = re.compile(r"(?m)^[ \t]*([A-Za-z_][\w.-]*)[ \t]*::=")
EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}|[()]'
                        r"|[A-Za-z_][\w.-]*|#[^\n]*|\S", re.S | re.ASCII)


# A regex's tokens for the lexical count: an escape, a class, a {m,n} repeat (groups 1-3), a bracket, a character
REGEX_TOKEN = re.compile(r"\\.|\[\^?\]?(?:[^\]\\]|\\.)*\]|\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}|.", re.S | re.ASCII)


def bounded_grammar(grammar: str, where: str) -> str:
    """An EBNF grammar (structured_outputs.grammar, genai's own dialect), if its repeats written out
    (grammar_atoms) stay within lark_grammar.MAX_REGEX_ATOMS; else a 400 naming `where`."""
    if grammar_atoms(grammar) > lark_grammar.MAX_REGEX_ATOMS:
        raise InvalidRequest(f"'{where}': the grammar is more than {lark_grammar.MAX_REGEX_ATOMS} symbols once its "
                             "repeats are written out (nested {m,n} repeats multiply, across rules too)", where,
                             TOO_LARGE)
    return grammar


def grammar_atoms(grammar: str) -> int:
    """The symbols of an EBNF grammar's `root` with its {m,n} repeats written out and the rules it uses written
    in place (a rule used inside itself counts once): what genai expands (three nested {100} repeats took it
    25 s). An upper bound: alternatives add up. Saturates just past MAX_REGEX_ATOMS."""
    starts = list(EBNF_RULE.finditer(grammar))
    bodies = {m.group(1): grammar[m.end(): following.start() if following else len(grammar)]
              for m, following in zip(starts, starts[1:] + [None])}
    sizes: dict[str, int] = {}

    def rule(name: str) -> int:
        if name not in sizes:
            sizes[name] = 1  # while it is counted: a recursive use is a rule, written once
            sizes[name] = body(bodies[name])
        return sizes[name]

    def body(text: str) -> int:
        return written_out(EBNF_TOKEN.finditer(text), lambda token: rule(token) if token in bodies else
                           1 if token[0] in "\"[" else 0)

    return rule("root") if "root" in bodies else body(grammar)


def written_out(tokens: Any, atoms: Any) -> int:
    """The atoms of a token sequence with its groups' {m,n} repeats written out (nested repeats multiply), from
    matches whose groups 1-3 are a repeat's low, comma and high, `(` and `)` tokens, and atoms(token) for any
    other; saturates just past MAX_REGEX_ATOMS. Lexical: it needs no parser to agree with genai's."""
    cap = lark_grammar.MAX_REGEX_ATOMS + 1
    groups: list[list[int]] = [[]]
    for match in tokens:
        token = match.group(0)
        if token == "(":
            groups.append([])
        elif token == ")" and len(groups) > 1:
            inner = groups.pop()
            groups[-1].append(min(sum(inner), cap))
        elif match.group(1) is not None and groups[-1]:
            low, comma, high = int(match.group(1)), match.group(2), match.group(3)
            copies = max(low + 1 if comma and not high else int(high or low), 1)
            groups[-1][-1] = min(groups[-1][-1] * copies, cap)
        elif match.group(1) is None:
            groups[-1].append(atoms(token))
    while len(groups) > 1:  # an unclosed group: still counted
        inner = groups.pop()
        groups[-1].append(min(sum(inner), cap))
    return min(sum(groups[0]), cap)


def bounded_schema(schema: Any, where: str) -> Any:
    """The schema, if written out (each `$ref` as the schema it names, each pattern's repeats) it stays within
    MAX_SCHEMA_CHARS; else a 400 naming `where`. Counted on the schema as it is, each referenced schema once."""
    if schema_size(schema) > MAX_SCHEMA_CHARS:
        raise InvalidRequest(f"'{where}': the JSON schema is more than {MAX_SCHEMA_CHARS} characters with its "
                             "$refs written out in place", where, TOO_LARGE)
    return schema


def schema_size(root: Any) -> int:
    """The size of `root` with its local $refs ("#/...") written out, saturating past MAX_SCHEMA_CHARS."""
    sizes: dict[str, int] = {}
    cap = MAX_SCHEMA_CHARS + 1

    def ref_size(ref: str) -> int:
        if ref not in sizes:
            sizes[ref] = REF_CYCLE_CHARS  # while it is counted: a reference back into it is a recursive rule
            target = resolve(root, ref)
            sizes[ref] = size(target) if target is not None else len(ref)
        return sizes[ref]

    def size(node: Any) -> int:
        pending, total = [node], 0
        while pending and total <= cap:  # iterative: depth is fields.MAX_JSON_DEPTH's, breadth the body's
            item = pending.pop()
            if isinstance(item, dict):
                total += 2 + sum(len(key) + 4 for key in item)
                for key, value in item.items():
                    if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                        total += ref_size(value)
                    elif key == "pattern" and isinstance(value, str):
                        total += regex_size(value)
                    elif key == "patternProperties" and isinstance(value, dict):
                        total += sum(regex_size(pattern) for pattern in value)
                        pending += value.values()
                    else:
                        pending.append(value)
            elif isinstance(item, list):
                total += 2 + len(item)
                pending += item
            else:
                total += len(json.dumps(item)) if not isinstance(item, str) else len(item) + 2
        return min(total, cap)

    return size(root)


def regex_size(regex: str) -> int:
    """A regex's atoms written out; past MAX_REGEX_ATOMS, more than any schema may be (a pattern is as
    much a regex constraint as structured_outputs.regex). Python's parse counts it where Python reads it; one in
    genai's dialect only (`(?<name>...)`, `\\p{L}`) is counted lexically: genai compiled `(?<n>((a{100}){100}){100})`,
    which Python cannot read, for 12 s in the worker."""
    try:
        atoms = lark_grammar.regex_atoms(regex)
    except lark_grammar.GrammarNotConvertible:
        atoms = written_out(REGEX_TOKEN.finditer(regex), lambda token: len(token) if token[0] == "[" else 1)
    return atoms if atoms <= lark_grammar.MAX_REGEX_ATOMS else MAX_SCHEMA_CHARS + 1


def resolve(root: Any, ref: str) -> Any:
    """The schema a local JSON pointer ("#/$defs/a") names in `root`, or None."""
    node = root
    for part in ref.lstrip("#").strip("/").split("/") if ref.strip("#/") else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and POINTER_INDEX.fullmatch(part) and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def prompt_fits(gen: Any, max_context: int) -> None:
    """A 400 context_length_exceeded for a generation request (appliance.front.api.completions.GenerationRequest)
    whose text (messages, prompt, the tools the template shows) is longer than max_context × MAX_CHARS_PER_TOKEN
    characters: it cannot fit, whatever the tokenizer, so the worker is not asked to count it."""
    tools = gen.tools.tools if gen.tools.active else []
    prompt_chars_fit(text_chars(gen.messages) + len(gen.prompt) + text_chars(tools), max_context, gen.model)


def prompt_chars_fit(chars: int, max_context: int, model: str) -> None:
    """The 400 of prompt_fits (and of a token count, /v1/messages/count_tokens, of such a prompt)."""
    if chars > max_context * MAX_CHARS_PER_TOKEN:
        raise RequestFailed(400, "invalid_request", f"the prompt is {chars} characters long; model '{model}' "
                            f"takes {max_context} tokens, which no tokenizer writes in more than "
                            f"{max_context * MAX_CHARS_PER_TOKEN} characters", "context_length_exceeded")


def text_chars(value: Any) -> int:
    """The characters of every string in a JSON value, keys included (iterative: depth is the body's)."""
    pending, total = [value], 0
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(key) for key in item if isinstance(key, str))
            pending += item.values()
        elif isinstance(item, list):
            pending += item
    return total
