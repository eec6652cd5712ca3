"""What a request's constraints make its worker compile, counted in the front before they are sent (issue 36):
a regex (structured_outputs.regex, a custom tool's regex format, a schema's `pattern`) by the EBNF its nested
repeats write out, a JSON schema by its size with every `$ref` written out in place. genai compiles a constraint
in the worker, where one that takes long (a regex of three nested {100} repeats: 30 s) is taken for a hung
pipeline; past these limits a constraint is a 400 naming the limit, before any work is done.
"""

from __future__ import annotations

import json
from typing import Any

from appliance.front.api import lark_grammar
from appliance.front.api.errors import InvalidRequest

TOO_LARGE = lark_grammar.TOO_LARGE  # the error code of a constraint past a limit
MAX_SCHEMA_CHARS = 1 << 20  # a JSON schema written out: every $ref in place, every pattern's repeats
REF_CYCLE_CHARS = 16  # a $ref to a schema it is inside: a recursive rule, written once


def bounded_regex(regex: str, where: str) -> str:
    """The regex, if written out (lark_grammar.regex_atoms) it stays within lark_grammar.MAX_REGEX_ATOMS; else a
    400 naming `where`. A regex Python cannot parse is left to genai to judge (its dialect is not Python's)."""
    if _regex_size(regex) > lark_grammar.MAX_REGEX_ATOMS:
        raise InvalidRequest(f"'{where}': the regex is more than {lark_grammar.MAX_REGEX_ATOMS} characters once "
                             "its repeats are written out (nested {m,n} repeats multiply)", where, TOO_LARGE)
    return regex


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
                        total += _regex_size(value)
                    elif key == "patternProperties" and isinstance(value, dict):
                        total += sum(_regex_size(pattern) for pattern in value)
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


def _regex_size(regex: str) -> int:
    """A regex's atoms written out; past MAX_REGEX_ATOMS, more than any schema may be (a pattern is as
    much a regex constraint as structured_outputs.regex)."""
    try:
        atoms = lark_grammar.regex_atoms(regex)
    except lark_grammar.GrammarNotConvertible:
        return len(regex)
    return atoms if atoms <= lark_grammar.MAX_REGEX_ATOMS else MAX_SCHEMA_CHARS + 1


def resolve(root: Any, ref: str) -> Any:
    """The schema a local JSON pointer ("#/$defs/a") names in `root`, or None."""
    node = root
    for part in ref.lstrip("#").strip("/").split("/") if ref.strip("#/") else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
