"""The grammars built from JSON constraints admit valid JSON only: no raw control characters
(U+0000-U+001F) inside strings, which RFC 8259 forbids and strict `json.loads` refuses."""
from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from runtime.config import EngineConfig
from runtime.structured_output import StructuredOutputsParams
from runtime.config.structured_outputs import StructuredOutputsConfig
from runtime.structured_output.backends import check
from runtime.structured_output.grammar import GrammarCompiler, build_grammar
from runtime.structured_output.params import MAX_WHITESPACE_CNT

BOUNDED = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
           "required": ["a"], "additionalProperties": False}
CONSTRAINTS = [
    {"json": BOUNDED},
    {"json": {"type": "object", "properties": {"a": {"type": "string", "minLength": 1}},
              "required": ["a"]}},
    {"json": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}},
    {"json_object": True},
]


def accepts(params: StructuredOutputsParams, text: str) -> bool:
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(build_grammar(params))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.mark.parametrize("kind", CONSTRAINTS, ids=lambda k: json.dumps(k)[:60])
@pytest.mark.parametrize("whitespace", [False, True])
@pytest.mark.parametrize("char", ["\x00", "\x10", "\x18", "\t", "\x1f"])
def test_raw_control_characters_are_refused_in_strings(kind, whitespace, char):
    params = StructuredOutputsParams(**kind, disable_any_whitespace=not whitespace)
    escaped = json.dumps({"a": f"x{char}"}, separators=(",", ": "))
    # a string bounded by minLength or maxLength takes no escapes (as xgrammar's own rule)
    assert accepts(params, escaped) != ("Length" in json.dumps(kind))
    assert not accepts(params, escaped.replace(json.dumps(char)[1:-1], char))


def test_bounded_strings_count_characters_and_take_no_escapes():
    params = StructuredOutputsParams(json=BOUNDED, disable_any_whitespace=True)
    for value in ['"abc"', '""', '"é/ "']:
        assert accepts(params, '{"a": ' + value + "}"), value
    for value in ['"abcd"', '"a\\nb"', '"\\""', '"\\u00e9"']:
        assert not accepts(params, '{"a": ' + value + "}"), value


def test_the_mask_refuses_a_token_holding_a_control_character(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    control = [i for i in range(len(tokenizer)) if any(c < " " for c in tokenizer.decode([i]))]
    printable = tokenizer.convert_tokens_to_ids("a")
    assert control
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(compiler.compile(
        StructuredOutputsParams(json=BOUNDED, disable_any_whitespace=True)))
    assert matcher.accept_string('{"a": "')
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, len(tokenizer))
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    allowed = logits[0] == 0
    assert allowed[printable]
    assert not allowed[control].any(), [tokenizer.decode([i]) for i in control if allowed[i]]


@pytest.mark.parametrize("kind", [{"json": BOUNDED}, {"json_object": True}])
def test_whitespace_between_tokens_is_bounded(kind):
    params = StructuredOutputsParams(**kind)
    assert accepts(params, '{\n' + " " * (MAX_WHITESPACE_CNT - 1) + '"a":\t"b"}')
    assert not accepts(params, '{\n' + " " * MAX_WHITESPACE_CNT + '"a": "b"}')


def test_the_backend_is_chosen_by_vllms_names():
    assert StructuredOutputsConfig.parse(None).resolved_backend == "xgrammar"
    assert StructuredOutputsConfig.parse('{"backend": "guidance"}').backend == "guidance"
    assert EngineConfig(structured_outputs_config={"backend": "xgrammar"}) \
        .structured_outputs_config.resolved_backend == "xgrammar"
    for bad, match in (({"backend": "outlines"}, "must be one of"),
                       ({"backends": "guidance"}, "takes backend"), ("{", "not valid JSON")):
        with pytest.raises(ValueError, match=match):
            StructuredOutputsConfig.parse(bad)


def test_the_guidance_backend_takes_lark_and_gbnf_and_refuses_structural_tags():
    pytest.importorskip("llguidance")
    check(StructuredOutputsParams(grammar='start: "a" b\nb: "b"+'), "guidance")
    check(StructuredOutputsParams(grammar='root ::= "a" [0-9]+'), "guidance")
    with pytest.raises(ValueError, match="structured_outputs.grammar is not a valid grammar"):
        check(StructuredOutputsParams(grammar="root ::= (unclosed"), "guidance")
    with pytest.raises(ValueError, match="structural_tag is xgrammar's"):
        check(StructuredOutputsParams(structural_tag='{"type": "structural_tag"}'), "guidance")


def test_the_guidance_backend_bounds_whitespace_too(tokenizer_dir):
    pytest.importorskip("llguidance")
    from runtime.structured_output.guidance import GuidanceCompiler
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    compiler = GuidanceCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = compiler.compile(StructuredOutputsParams(json_object=True))

    def takes(text: str) -> bool:
        matcher = compiler.matcher(compiled)
        return all(matcher.accept_token(t)
                   for t in tokenizer.encode(text, add_special_tokens=False))
    assert takes('{\n' + " " * (MAX_WHITESPACE_CNT - 1) + '"a": "b"}')
    assert not takes('{\n' + " " * MAX_WHITESPACE_CNT + '"a": "b"}')


@pytest.mark.parametrize("schema, named", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"anyOf": [{"not": {"type": "string"}}, {"type": "null"}]}, "not"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if, then"),
    ({"type": "string", "pattern": "(?=a)a+"}, "lookaround"),
    ({"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}, "local refs"),
    ({"$ref": "https://example.com/schema.json"}, "local refs"),
])
def test_schema_keywords_xgrammar_would_drop_are_refused(schema, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        check(StructuredOutputsParams(json=schema), "xgrammar")


def test_keywords_are_told_from_property_names_and_local_refs_resolve():
    check(StructuredOutputsParams(json={"type": "object", "properties": {
        "not": {"type": "integer"}, "if": {"$ref": "#/$defs/s"}}, "$defs": {
        "s": {"type": "string"}}}), "xgrammar")


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("grammar", ["root ::= root", "root ::= [^\\x00-\\U0010FFFF]"])
def test_a_grammar_that_allows_no_output_is_refused(backend, grammar):
    if backend == "guidance":
        pytest.importorskip("llguidance")
    with pytest.raises(ValueError, match="allows no output|not a valid"):
        check(StructuredOutputsParams(grammar=grammar), backend)


def test_the_guidance_backend_takes_thousands_of_choices(tokenizer_dir):
    """3,000 choices as rule alternatives put 3,001 items in a parser row after the first
    token, over llguidance's limit of 2,000: the choice is one terminal instead."""
    pytest.importorskip("llguidance")
    from runtime.structured_output.guidance import GuidanceCompiler
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    compiler = GuidanceCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    choices = [f"option {i}" for i in range(3000)]
    compiled = compiler.compile(StructuredOutputsParams(choice=choices))
    for text, taken in (("option 2999", True), ("option 3000", False)):
        matcher = compiler.matcher(compiled)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert all(matcher.accept_token(t) for t in ids) == taken, text
    assert matcher.is_terminated()  # "option 300" is complete: no choice goes on from it
