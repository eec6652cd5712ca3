"""Lark grammars (OpenAI custom tools' `format`) as genai's EBNF, and the answer side of custom tool calls: pure
functions, no processes. That genai compiles and enforces the EBNF is shown live in test_agents_conformance.py."""

from __future__ import annotations

import re

import pytest

from appliance.front.api.answer import AnswerParser
from appliance.front.api.lark_grammar import GrammarNotConvertible, lark_to_ebnf, regex_ebnf
from appliance.front.api.tool_parsers import HermesParser, Qwen3CoderParser
from appliance.front.api.tools import lark_grammars
from conftest import FIXTURES

APPLY_PATCH = (FIXTURES / "agents" / "codex_apply_patch.lark").read_text()


def rules(ebnf: str) -> dict[str, str]:
    return dict(line.split(" ::= ", 1) for line in ebnf.splitlines())


def test_codex_apply_patch_converts_rule_by_rule():
    ebnf = rules(lark_to_ebnf(APPLY_PATCH))
    assert ebnf["root"] == "r_start"
    assert ebnf["r_start"] == "r_begin_patch g_start_plus_0 r_end_patch"  # hunk+ as lark expands it
    assert ebnf["g_start_plus_0"] == "r_hunk | g_start_plus_0 r_hunk"
    assert ebnf["r_end_patch"] == "g_ANON_1 t_LF | g_ANON_1"  # LF?
    assert ebnf["t_LF"] == '"\\n"'  # %import common.LF
    assert ebnf["g_ANON_5"] == "[^\\n]+"  # filename: /(.+)/
    assert ebnf["g_ANON_6"] == "[^\\n]*"  # /(.*)/
    assert ebnf["r_add_line"] == "t_PLUS g_ANON_6 t_LF"  # "-> line" names the tree node only
    assert '"*** Begin Patch"' in ebnf.values() and '"*** End of File"' in ebnf.values()
    # every symbol used is defined
    used = {word for body in ebnf.values() for word in re.findall(r"\b[rtg]_\w+", body)}
    assert used <= set(ebnf)


@pytest.mark.parametrize("regex, ebnf", [
    ("abc", '("a" "b" "c")'),
    ("[a-z_]+", "[a-z_]+"),
    ("[^\\]x-]", "[^\\]x\\-]"),
    ("\\d{2,3}", "[0-9]{2,3}"),
    ("\\w*", "[a-zA-Z0-9_]*"),
    ("\\S", "[^ \\t\\n\\r\\u000c\\u000b]"),
    ("a|bc", '("a" | ("b" "c"))'),
    ("(?s).", "[\\u0000-\\U0010ffff]"),
    ('"\\\\', '("\\"" "\\\\")'),
    ("x{3}", '"x"{3}'),
    ("x{2,}", '"x"{2,}'),
    ("(ab){0,500}", '("a" "b"){0,500}'),  # genai's own repeat: copies of `x?` compiled in seconds
    ("(a{2}){3}", '("a"{2}){3}'),
    ("(?:[0-9]+)?", "([0-9]+)?"),
    ("a.*?b", '("a" [^\\n]* "b")'),  # lazy or greedy: the same language
])
def test_regex_terminals_become_ebnf(regex, ebnf):
    assert regex_ebnf(regex) == ebnf


@pytest.mark.parametrize("grammar, words", [
    ('start: WORD\n%import common.WORD\n%ignore " "', "%ignore"),
    ("start: /(?=a)a/", "lookahead"),
    ("start: /(?!a)b/", "negative lookahead"),
    ("start: /(a)\\1/", "back-references"),
    ("start: /^a$/", "anchors"),
    ("start: /a/i", "flags i"),
    ('start: "a"i', "case-insensitive"),
    ("start: /((((a){64}){64}){64}){64}/", "nested repeats multiply"),  # issue 36: 67 MB of EBNF
    ("start: missing", "does not load"),
    ("start: (", "does not load"),
    ("other: \"a\"", "no 'start' rule"),
    ("start: /(?i)abc/", "case-insensitive"),  # an inline flag, not lark's /.../i
    ("%declare X\nstart: X", "%declare (X)"),
    ("%import grammars.secret.KEY\nstart: KEY", "only lark's own grammars"),
    ("%import .secret.KEY\nstart: KEY", "only lark's own grammars"),
])
def test_what_has_no_ebnf_form_is_refused_naming_the_construct(grammar, words):
    with pytest.raises(GrammarNotConvertible, match=re.escape(words)):
        lark_to_ebnf(grammar)


def test_an_import_never_reads_the_servers_files(tmp_path, monkeypatch):
    (tmp_path / "secret.lark").write_text('KEY: "the server\'s own file"\n')
    monkeypatch.chdir(tmp_path)  # where lark looked for a relative or unknown import
    for grammar in ("%import .secret.KEY\nstart: KEY", "%import secret.KEY\nstart: KEY"):
        with pytest.raises(GrammarNotConvertible, match="only lark's own grammars"):
            lark_to_ebnf(grammar)
    assert rules(lark_to_ebnf("%import common.LF\nstart: LF"))["t_LF"] == '"\\n"'


@pytest.mark.parametrize("grammar", ['start: a+ _start_plus_0\n_start_plus_0: "x"\na: "y"\n',
                                     'start: ANON_0 "b" _X X\nANON_0: "a"\n_X: "c"\nX: "d"\n'])
def test_a_grammars_own_names_never_clash_with_lark_s(grammar):
    # each symbol once (lark's __start_plus_0 and __ANON_0 and a grammar's _start_plus_0, ANON_0, _X and X were
    # written under the same names: two definitions of one symbol)
    names = [line.split(" ::= ")[0] for line in lark_to_ebnf(grammar).splitlines()]
    assert len(names) == len(set(names)), names


def test_templates_priorities_and_inlined_rules_convert():
    grammar = ('start: pair{"a", "b"} item\n?item: NUMBER | _word\n_word: /[a-z]+/\npair{x, y}: x y\n'
               "NUMBER.2: /[0-9]+/\n")
    ebnf = rules(lark_to_ebnf(grammar))
    assert ebnf["root"] == "r_start" and "[0-9]+" in ebnf.values() and "[a-z]+" in ebnf.values()


# --- custom calls in answers --------------------------------------------------------------------------------------

def split(parser, pieces: list[str], cut: bool = False, custom=frozenset({"apply_patch"}), stream=False):
    answer = AnswerParser(False, parser, stream_arguments=stream, custom_tools=frozenset(custom))
    deltas = [d for piece in pieces for d in answer.feed(piece)] + answer.finish(cut)
    return answer, deltas


def test_a_custom_call_streams_its_input_in_the_chat_shape_however_the_text_is_cut():
    text = 'Sure.<custom_tool_call name="apply_patch">*** Begin Patch\n*** End Patch\n</custom_tool_call>'
    for size in (1, 3, 7, len(text)):
        answer, deltas = split(HermesParser(), [text[i:i + size] for i in range(0, len(text), size)])
        assert "".join(d.get("content", "") for d in deltas) == "Sure."
        calls = [c for d in deltas for c in d.get("tool_calls", ())]
        assert calls[0]["type"] == "custom" and calls[0]["custom"]["name"] == "apply_patch"
        assert "".join(c["custom"]["input"] for c in calls) == "*** Begin Patch\n*** End Patch\n"
        assert not answer.cut_short
        [call] = answer.message(text)["tool_calls"] if size == len(text) else [answer.calls[0].message()]
        assert call["custom"]["input"] == "*** Begin Patch\n*** End Patch\n"


def test_a_custom_call_cut_short_keeps_its_input_and_a_head_cut_short_is_no_content():
    answer, deltas = split(HermesParser(), ['<custom_tool_call name="apply_patch">*** Begin'], cut=True)
    assert answer.cut_short and answer.calls[0].arguments == "*** Begin"
    answer, deltas = split(HermesParser(), ["<custom_tool_call name"], cut=True)
    assert deltas == [] and not answer.calls


def test_a_tag_naming_no_custom_tool_is_content():
    text = '<custom_tool_call name="rm_rf">x</custom_tool_call>'
    answer, deltas = split(HermesParser(), [text])
    assert not answer.calls and "".join(d["content"] for d in deltas) == text


def test_a_custom_tool_called_the_familys_way_is_a_custom_call():
    text = '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n"}}\n</tool_call>'
    answer, _ = split(HermesParser(), [text])
    assert answer.calls[0].message() == {"id": answer.calls[0].id, "type": "custom",
                                         "custom": {"name": "apply_patch", "input": "*** Begin Patch\n"}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_cut_by_max_tokens_is_a_call_with_its_arguments_so_far(stream):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": " calm willow'
    answer, deltas = split(HermesParser(), [text[:20], text[20:]], cut=True, custom=(), stream=stream)
    assert not any("content" in d for d in deltas) and answer.cut_short
    [call] = answer.calls
    assert call.name == "get_weather" and call.arguments == '{"city": " calm willow'
    # not cut (the model stopped there): what it wrote is content, as before
    answer, deltas = split(HermesParser(), [text], cut=False, custom=())
    assert "".join(d["content"] for d in deltas) == text and not answer.calls


def test_a_qwen3_coder_call_cut_short_keeps_the_parameters_that_ended():
    parser = Qwen3CoderParser({"get_weather": {"properties": {"city": {"type": "string"}, "days": {}}}})
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3"
    answer, deltas = split(parser, [text], cut=True, custom=())
    assert not any("content" in d for d in deltas) and answer.cut_short
    assert answer.calls[0].name == "get_weather" and answer.calls[0].arguments == '{"city": "Paris"}'


def test_a_cut_call_whose_name_never_came_leaks_no_markup():
    for parser, text in ((HermesParser(), '<tool_call>\n{"na'), (Qwen3CoderParser(), "<tool_call>\n<function=ge")):
        answer, deltas = split(parser, [text], cut=True, custom=())
        assert deltas == [] and not answer.calls


@pytest.mark.parametrize("name", ["get\\qweather", "get\nweather"])  # a bad escape, a raw newline: not JSON
def test_a_cut_call_whose_name_is_not_a_json_string_is_dropped_not_a_crash(name):
    text = '<tool_call>\n{"name": "' + name + '", "arguments": {"city": "Par'
    answer, deltas = split(HermesParser(), [text], cut=True, custom=())
    assert deltas == [] and not answer.calls


def codex_bodies(definition: str) -> list[dict]:
    """One custom Lark tool in chat completions' shape and in the Responses API's."""
    fmt = {"type": "grammar", "syntax": "lark", "definition": definition}
    return [{"tools": [{"type": "custom", "custom": {"name": "g", "format": {"type": "grammar", "grammar": {
        "syntax": "lark", "definition": definition}}}}]},
            {"tools": [{"type": "function", "name": "shell"}, {"type": "custom", "name": "g", "format": fmt}]}]


def test_the_grammars_of_both_shapes_are_found_for_conversion_before_parsing():
    for body in codex_bodies(APPLY_PATCH):
        assert lark_grammars(body) == [APPLY_PATCH]
    assert lark_grammars({"tools": [{"type": "custom", "name": "r", "format": {"type": "grammar", "syntax": "regex",
                                                                              "definition": "a+"}}]}) == []
    assert lark_grammars({"tools": "not a list"}) == lark_grammars([]) == []
