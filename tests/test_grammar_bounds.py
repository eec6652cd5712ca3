"""Issue 36, item 1: every conversion of client input that the worker gets is counted before it is written, and
refused past a documented limit in milliseconds; the front converts Lark grammars in a helper process, and its
cache keeps refusals and small results only. Pure functions (and the helper process), no server: the live
refusals are in test_hostile.py."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from hypothesis import given, settings, strategies as st

from appliance.front.api import bounds, grammar_helper, lark_grammar
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.lark_grammar import GrammarTooLarge, lark_to_ebnf, regex_atoms, regex_ebnf
from bench.hostile import NAMED_GROUP_REGEX_BOMB, NESTED_REPEATS, OPTIONALS_16, TEMPLATE_FANOUT, TERMINAL_DAG, schema_bomb
from conftest import FIXTURES

APPLY_PATCH = (FIXTURES / "agents" / "codex_apply_patch.lark").read_text()
BOMBS = {
    "nested repeats": NESTED_REPEATS,
    "16 optionals": OPTIONALS_16,
    "terminal DAG": TERMINAL_DAG,
    "rule repeat": 'start: a~100000\na: "x"',
    "group repeat": 'start: ("a"|"b")~20',
    "terminal repeat": 'start: A\nA: "x"~1000000',
    "template fan-out": TEMPLATE_FANOUT,
    # a class of 3,000 characters, repeated: genai compiled it for 9.6 s when a class counted as one character
    "wide class repeated": "start: A\nA: /[" + "".join(f"\\u{0x100 + 2 * i:04x}" for i in range(3000)) + "]{8}/",
    "nested templates": "t{x}: x x\nstart: " + "t{" * 9 + '"a"' + "}" * 9,
    "deep brackets": "start: " + "(" * 5000 + '"a"' + ")" * 5000,
    "long definition": 'start: "' + "a" * (lark_grammar.MAX_DEFINITION_CHARS + 1) + '"',
}
# A refusal is counting, not converting: milliseconds of CPU; this only catches a conversion that ran. CPU time, not
# wall time: under `make test` two cores are shared by three workers, and a 1.0 s wall bound failed on waiting alone.
BOUND_S = 1.0


@pytest.fixture(scope="module", autouse=True)
def lark_loaded():
    """lark imported and its grammar of grammars built (seconds on a loaded core), before anything is timed."""
    lark_to_ebnf(APPLY_PATCH)


@pytest.mark.parametrize("name", BOMBS)
def test_each_bomb_is_refused_as_too_large_before_lark_expands_it(name):
    started = time.process_time()
    result = lark_grammar.converted(BOMBS[name])
    spent = time.process_time() - started
    assert result.code == lark_grammar.TOO_LARGE and result.ebnf == "", result
    assert spent < BOUND_S, f"{name}: {spent:.2f} s of CPU"


def test_grammars_inside_the_limits_still_convert():
    assert lark_to_ebnf(APPLY_PATCH).startswith("root ::= r_start")
    ten = lark_to_ebnf("start: " + " ".join(f"x{i}?" for i in range(10)) + "\n"
                       + "".join(f'x{i}: "x"\n' for i in range(10)))  # 1,024 alternatives
    assert ten.count(" | ") == 1023
    assert "{64}" in lark_to_ebnf("start: A\nA: /(a{64}){64}/")  # 4,096 written out: within MAX_REGEX_ATOMS


REGEXES = st.recursive(
    st.sampled_from(["a", "[a-z]", ".", "\\d", "(?:ab)"]),
    lambda inner: st.one_of(
        st.tuples(inner, inner).map("".join),
        st.tuples(inner, inner).map(lambda pair: f"(?:{pair[0]}|{pair[1]})"),
        st.tuples(inner, st.integers(0, 40), st.integers(0, 40)).map(
            lambda t: f"(?:{t[0]}){{{min(t[1], t[2])},{max(t[1], t[2])}}}"),
        inner.map(lambda r: f"(?:{r})*")),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(REGEXES)
def test_a_regex_is_counted_before_it_is_written_and_refused_only_past_the_limit(regex):
    atoms = regex_atoms(regex)
    if atoms > lark_grammar.MAX_REGEX_ATOMS:
        with pytest.raises(GrammarTooLarge):
            regex_ebnf(regex)
    else:
        ebnf = regex_ebnf(regex)
        assert len(ebnf) <= 40 * len(regex) + 8  # repeats are genai's {m,n}: what is written grows with the regex


@pytest.mark.parametrize("regex", ["((a{100}){100}){100}", "((a{30}){30}){30}", "(.{0,200}){0,200}",
                                   NAMED_GROUP_REGEX_BOMB, "\\p{L}((a{30}){30}){30}", "[)]((a{30}){30}){30}"])
def test_a_regex_constraint_is_refused_past_the_limit(regex):
    with pytest.raises(InvalidRequest) as refused:
        bounds.bounded_regex(regex, "structured_outputs.regex")
    assert refused.value.code == "grammar_too_large" and refused.value.param == "structured_outputs.regex"


@settings(max_examples=200, deadline=None)
@given(REGEXES)
def test_a_regex_in_genais_dialect_only_is_refused_whenever_python_would_refuse_it(regex):
    """A named group as genai writes it, `(?<n>...)`, is no regex to Python: its repeats are still counted (genai
    compiled one of three nested {100} repeats for 12 s)."""
    named = f"(?<n>{regex})"
    assert bounds.regex_size(named) >= bounds.regex_size(regex)  # counted at least as Python counts it
    if regex_atoms(regex) > lark_grammar.MAX_REGEX_ATOMS:
        with pytest.raises(InvalidRequest):
            bounds.bounded_regex(named, "r")
        with pytest.raises(InvalidRequest):
            bounds.bounded_schema({"type": "string", "pattern": named}, "s")


def test_a_regex_inside_the_limit_and_one_python_cannot_read_pass_to_genai():
    assert bounds.bounded_regex("(a{100}){100}", "r") == "(a{100}){100}"
    assert bounds.bounded_regex("\\p{L}+", "r") == "\\p{L}+"  # genai's dialect is genai's to judge


def test_a_schema_that_expands_to_100_mb_is_refused_in_milliseconds():
    bomb = schema_bomb(21)  # 2 M leaves of 70 characters: over 100 MB written out, 3 KB as sent
    assert len(json.dumps(bomb)) < 4096
    started = time.process_time()
    with pytest.raises(InvalidRequest) as refused:
        bounds.bounded_schema(bomb, "response_format.json_schema.schema")
    assert time.process_time() - started < BOUND_S
    assert refused.value.code == "grammar_too_large"


def test_recursive_and_ordinary_schemas_pass():
    tree = {"$defs": {"node": {"type": "object", "properties": {"children": {"type": "array", "items": {
        "$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    assert bounds.bounded_schema(tree, "s") is tree
    assert bounds.bounded_schema(schema_bomb(8), "s")
    with pytest.raises(InvalidRequest, match="written out"):
        bounds.bounded_schema({"type": "string", "pattern": "((a{100}){100}){100}"}, "s")


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(blacklist_characters="/~"), min_size=1, max_size=4))
def test_a_ref_into_a_list_resolves_only_an_ascii_index_and_never_raises(part):
    """A JSON pointer's array index is ASCII digits (RFC 6901): "²" passed str.isdigit() and int() raised on it (a
    500 for the request whose schema held it); "١" was read as 1."""
    items = [{"type": "string"}, {"type": "integer"}]
    found = bounds.resolve({"prefixItems": items}, "#/prefixItems/" + part)
    index = int(part) if re.fullmatch(r"0|[1-9][0-9]*", part, re.ASCII) else None
    assert found == (items[index] if index is not None and index < len(items) else None), part
    assert bounds.bounded_schema({"prefixItems": items, "items": {"$ref": "#/prefixItems/" + part}}, "s")


def test_the_converter_process_converts_refuses_and_caches_only_refusals_and_small_results():
    async def run():
        converter = grammar_helper.GrammarConverter()
        big = "start: " + " | ".join(f"r{i}" for i in range(1500)) + "\n" + \
            "\n".join(f'r{i}: "w{i}"' for i in range(1500)) + "\n"  # ~60 KB of EBNF: not kept
        try:
            started = time.monotonic()
            await converter.convert([APPLY_PATCH, NESTED_REPEATS, big])
            found = grammar_helper.REQUEST_CONVERSIONS.get()
            assert found[APPLY_PATCH].refusal is None and found[big].refusal is None
            assert found[NESTED_REPEATS].code == lark_grammar.TOO_LARGE
            assert len(found[big].ebnf) > grammar_helper.CACHED_RESULT_CHARS
            cached = {key: value for key, value in converter.cache.items()}
            assert grammar_helper.digest(big) not in cached
            assert cached[grammar_helper.digest(APPLY_PATCH)].ebnf.startswith("root ::=")
            assert cached[grammar_helper.digest(NESTED_REPEATS)].refusal
            pid = converter.process._proc.pid
            await converter.convert([NESTED_REPEATS])  # a remembered refusal: no process asked
            assert converter.process._proc.pid == pid
            return time.monotonic() - started
        finally:
            await converter.close()

    asyncio.run(run())


def test_a_conversion_past_its_time_bound_is_stopped_and_refused():
    async def run():
        converter = grammar_helper.GrammarConverter(timeout_s=0.001)
        try:
            result = await converter._one(APPLY_PATCH + "\n// not cached\n")
            assert result.code == lark_grammar.TOO_LARGE and "was stopped" in result.refusal
            assert not converter.cache  # a slow host's refusal is not remembered
        finally:
            await converter.close()

    asyncio.run(run())


def test_the_cache_holds_the_refusals_of_a_storm_in_bounded_memory():
    async def run():
        converter = grammar_helper.GrammarConverter()
        for i in range(grammar_helper.CACHE_ENTRIES + 50):  # refused before the process: length
            await converter.convert(['start: "' + "a" * lark_grammar.MAX_DEFINITION_CHARS + f'{i}"'])
        assert len(converter.cache) == grammar_helper.CACHE_ENTRIES
        assert all(len(v.refusal) <= grammar_helper.MAX_REFUSAL_CHARS for v in converter.cache.values())
        assert converter.process._proc is None
        await converter.close()

    asyncio.run(run())


def test_the_refusal_reaches_the_client_as_a_400_naming_the_field():
    from appliance.front.api.tools import parse_tools
    body = {"tools": [{"type": "custom", "custom": {"name": "g", "format": {"type": "grammar", "grammar": {
        "syntax": "lark", "definition": NESTED_REPEATS}}}}]}
    with pytest.raises(InvalidRequest) as refused:
        parse_tools(body)
    assert refused.value.code == "grammar_too_large"
    assert re.search(r"tools\[0\]\.custom\.format\.grammar\.definition", refused.value.param)


@pytest.mark.parametrize("grammar, atoms", [
    ('root ::= ((("a"{100}){100}){100})', None),  # 25 s in genai
    ("root ::= a{10}\na ::= b{10}\nb ::= c{10} | \"x\"\nc ::= \"y\"{100}", None),  # across rules
    ("root ::= [a-z]{0,1000}", 1000),
    ('root ::= "a" root | "b"', 3),  # recursion is a rule, written once
    ('root ::= "{" "}"{3}', 4),  # braces in a string are text
])
def test_an_ebnf_grammar_constraint_counts_its_repeats_across_rules(grammar, atoms):
    if atoms is None:
        with pytest.raises(InvalidRequest) as refused:
            bounds.bounded_grammar(grammar, "structured_outputs.grammar")
        assert refused.value.code == "grammar_too_large"
    else:
        assert bounds.grammar_atoms(grammar) == atoms
