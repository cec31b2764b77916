"""Constraints as xgrammar grammars: built (and so checked) from the params, compiled against
the model's vocabulary."""
from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

import xgrammar as xgr

from runtime.structured_output.bitmask import pack_token_ids
from runtime.structured_output.params import MAX_WHITESPACE_CNT, StructuredOutputsParams


# JSON-schema keywords xgrammar 0.2.x drops without a word (its output then breaks the schema):
# refused, as llguidance refuses them. Refs must be local ("#/..."): remote and file:// refs are
# never fetched.
UNENFORCED_KEYWORDS = ("uniqueItems", "not", "if", "then", "else", "contains", "minContains",
                       "maxContains", "dependentRequired", "dependentSchemas",
                       "unevaluatedProperties", "unevaluatedItems")
# where a schema holds subschemas: one, a list of them, or a mapping of names to them
_ONE = ("items", "additionalProperties", "propertyNames", "additionalItems", *UNENFORCED_KEYWORDS)
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# xgrammar's C++ errors begin "[01:09:23] /project/cpp/grammar_parser.cc:820: ": its clock and
# source line, nothing a client can act on.
_XGRAMMAR_SOURCE = re.compile(r"^\[[0-9:]+\] \S+\.(?:cc|h):[0-9]+: ")
_LOOKAROUND = re.compile(r"\(\?<?[=!]|\\[1-9]")  # lookahead, lookbehind, backreference


def unenforced(schema: Any) -> list[str]:
    """What of the JSON schema xgrammar would not enforce: its keywords among
    UNENFORCED_KEYWORDS, non-local `$ref`s, and `pattern`s with lookaround or backreferences
    (a schema's keywords only: a property may be called "not")."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        found += [k for k in UNENFORCED_KEYWORDS if k in node]
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            found.append(f"$ref {ref!r} (only local refs, #/..., are resolved)")
        pattern = node.get("pattern")
        if isinstance(pattern, str) and _LOOKAROUND.search(pattern):
            found.append(f"pattern {pattern!r} (lookaround and backreferences)")
        for key in _ONE:
            stack.append(node.get(key))
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _MAP:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
    return found


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar of `params`; raises ValueError naming the field when it does not parse.

    Cheap (no vocabulary involved): the API process calls it to refuse bad requests early.
    """
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            refused = unenforced(json.loads(schema) if isinstance(schema, str) else schema)
            if refused:
                raise ValueError(f"the xgrammar backend cannot enforce "
                                 f"{', '.join(sorted(set(refused)))}")
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
        message = _XGRAMMAR_SOURCE.sub("", message)
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


@lru_cache(maxsize=1)
def _byte_compiler() -> xgr.GrammarCompiler:
    """A compiler for a vocabulary of the 256 bytes and a stop token (id 256)."""
    vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[256])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def allows_output(grammar: xgr.Grammar) -> bool:
    """Whether `grammar` derives anything at all (`root ::= root` and an empty character class
    do not): some byte, or the end, is allowed at its start."""
    matcher = xgr.GrammarMatcher(_byte_compiler().compile_grammar(grammar))
    bitmask = xgr.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


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

    def size_of(self, compiled: xgr.CompiledGrammar) -> int:
        return compiled.memory_size_bytes
