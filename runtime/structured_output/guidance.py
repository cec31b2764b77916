"""Constraints as llguidance grammars (the "guidance" backend): JSON schemas, regexes, choices
and grammars in Lark syntax (a GBNF grammar is converted); only this module imports llguidance."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.hf import from_tokenizer

from runtime.structured_output.bitmask import pack_token_ids
from runtime.structured_output.params import MAX_WHITESPACE_CNT, StructuredOutputsParams

# JSON's whitespace between tokens, bounded as the xgrammar backend bounds it
_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,%d}" % MAX_WHITESPACE_CNT
LEXER_STATE_BYTES = 256 * 2**10  # a compiled grammar's size past its text, as estimated


def build_guidance_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of `params`; raises ValueError naming the field when it does not
    parse. Cheap (no vocabulary involved), so the API process can refuse bad requests early."""
    kind = params.kind
    if kind == "structural_tag":
        raise ValueError("structured_outputs.structural_tag is xgrammar's: the guidance backend "
                         "does not take it (use --structured-outputs-config "
                         "'{\"backend\": \"xgrammar\"}')")
    try:
        if kind in ("json", "json_object"):
            flexible = not params.disable_any_whitespace
            grammar = LLMatcher.grammar_from_json_schema(
                params.json if kind == "json" else {"type": "object"},
                defaults={"whitespace_flexible": flexible,
                          "whitespace_pattern": _WHITESPACE if flexible else None})
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(params.regex)
        elif kind == "choice":
            # one terminal (a regex to llguidance's lexer): as rule alternatives, 2,000 or more
            # choices pass llguidance's limit of items in a parser row once the first token
            # is in, and the request fails there
            grammar = LLMatcher.grammar_from_lark(
                "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in params.choice))
        else:
            grammar = LLMatcher.grammar_from_lark(any_to_lark(params.grammar))
    except Exception as e:  # the GBNF converter raises its own error types
        raise ValueError(f"structured_outputs.{kind} is not a valid {kind}: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"structured_outputs.{kind} is not a valid {kind}: "
                         f"{error.strip().splitlines()[0]}")
    return grammar


class _ByteTokenizer:
    """The 256 bytes and a stop token (id 256), as llguidance's TokenizerWrapper reads one."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_BYTES: list[LLTokenizer] = []  # made on first use


def allows_output(grammar: str) -> bool:
    """Whether `grammar` derives anything at all (`start: start` does not): llguidance finds
    no error computing the mask of its start over a byte vocabulary."""
    if not _BYTES:
        _BYTES.append(LLTokenizer(TokenizerWrapper(_ByteTokenizer())))
    matcher = LLMatcher(_BYTES[0], grammar, log_level=0)
    words = np.zeros(-(-257 // 32), dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    return not matcher.is_error() and bool(words.any())


class GuidanceMatcher:
    """An llguidance matcher behind the calls the manager makes of xgrammar's."""

    def __init__(self, matcher: LLMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        # llguidance's matcher breaks for good on a refused token; refuse it before
        return self._matcher.validate_tokens([token_id]) == 1 and \
            self._matcher.consume_token(token_id)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """Only stop tokens can follow (taken or not: llguidance stops before them)."""
        return self._matcher.is_stopped()


@dataclass
class CompiledGuidance:
    matcher: LLMatcher  # in its start state
    grammar_bytes: int  # of the grammar's serialized text


class GuidanceCompiler:
    """The llguidance tokenizer of one vocabulary, and grammars compiled against it (the same
    attributes as `grammar.GrammarCompiler`)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = from_tokenizer(tokenizer, n_vocab=vocab_size,
                                         eos_token=list(stop_token_ids))
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.stop_bitmask = pack_token_ids(stop_token_ids, vocab_size)

    def compile(self, params: StructuredOutputsParams) -> CompiledGuidance:
        """A matcher in its start state, which each sequence's matcher copies."""
        grammar = build_guidance_grammar(params)
        matcher = LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {matcher.get_error()}")
        return CompiledGuidance(matcher, len(grammar))

    def matcher(self, compiled: CompiledGuidance) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.matcher.deep_copy())

    def size_of(self, compiled: CompiledGuidance) -> int:
        """An estimate (llguidance does not report it): the grammar's text and room for the
        lexer states it builds as masks are computed."""
        return compiled.grammar_bytes + LEXER_STATE_BYTES
