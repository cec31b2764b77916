"""Constraints as xgrammar grammars: built (and so checked) from the params, compiled against
the model's vocabulary."""
from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from runtime.structured_output.bitmask import pack_token_ids
from runtime.structured_output.params import MAX_WHITESPACE_CNT, StructuredOutputsParams


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar of `params`; raises ValueError naming the field when it does not parse.

    Cheap (no vocabulary involved): the API process calls it to refuse bad requests early.
    """
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            return json_schema_grammar(schema if isinstance(schema, str) else json.dumps(schema),
                                       any_whitespace=not params.disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(params.grammar)
        return xgr.Grammar.from_structural_tag(params.structural_tag)
    except (RuntimeError, ValueError, TypeError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"structured_outputs.{kind} is not a valid {kind}: {message}") from None


# xgrammar (0.2.x, mlc-ai/xgrammar#800) writes one character of a string bounded by minLength or
# maxLength (property values and propertyNames) as a rule of its own that admits the raw control
# characters U+0000-U+001F, which RFC 8259 forbids in strings, and no escape at all.
_BOUNDED_STRING_CHAR = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
# One unescaped JSON character: not a control, '"' or '\\'. It stays one character class, as
# xgrammar's: an escape alternative inside the bounded repetition makes every token's mask
# depend on the count so far (20 ms per fill for a 49152-token vocabulary instead of 0.01 ms).
_JSON_STRING_CHAR = r'\1 ::= [^\\0-\\x1f\\"\\\\]'


def json_schema_grammar(schema: str, any_whitespace: bool) -> xgr.Grammar:
    """xgrammar's grammar of the JSON schema, its bounded-string characters made JSON's."""
    grammar = xgr.Grammar.from_json_schema(
        schema, any_whitespace=any_whitespace,
        max_whitespace_cnt=MAX_WHITESPACE_CNT if any_whitespace else None)
    ebnf, fixed = _BOUNDED_STRING_CHAR.subn(_JSON_STRING_CHAR, str(grammar))
    return xgr.Grammar.from_ebnf(ebnf) if fixed else grammar


def choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" ...: EBNF string literals escape as JSON strings do."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    """Compiles grammars for one vocabulary: `vocab_size` is the width of the model's logits
    (a padded vocabulary's extra ids are never allowed), `stop_token_ids` end the output once
    the grammar is complete."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        # the bitmask row of a complete grammar: stop tokens only
        self.stop_bitmask = pack_token_ids(stop_token_ids, vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return self._compiler.compile_grammar(build_grammar(params))

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)
