"""The grammar backends behind one interface, by vLLM's names: "xgrammar" (the default; "auto"
picks it) and "guidance" (llguidance). A backend checks a request's constraint (cheap, in the
API process) and compiles it for the model's vocabulary (in the engine core); each is imported
only when used (xgrammar takes seconds to import)."""
from __future__ import annotations

from typing import Any

from runtime.structured_output.params import StructuredOutputsParams


def check(params: StructuredOutputsParams, backend: str = "auto") -> None:
    """Raise ValueError naming the field when `backend` cannot take the constraint (at once
    when the server's grammar checker has checked it with this backend)."""
    if params._checked_by == backend:
        return
    if backend == "guidance":
        from runtime.structured_output.guidance import allows_output, build_guidance_grammar
        grammar = build_guidance_grammar(params)
    else:
        from runtime.structured_output.grammar import allows_output, build_grammar
        grammar = build_grammar(params)
    if not allows_output(grammar):
        raise ValueError(f"structured_outputs.{params.kind} allows no output at all (a rule "
                         "that only derives itself, or an empty character class)")


def make_compiler(backend: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
    """The backend's compiler for the vocabulary: `compile(params)` (in a pool thread), then
    `matcher(compiled)` for each sequence; `vocab_size`, `stop_token_ids`, `stop_bitmask`."""
    if backend == "guidance":
        from runtime.structured_output.guidance import GuidanceCompiler
        return GuidanceCompiler(tokenizer, vocab_size, stop_token_ids)
    from runtime.structured_output.grammar import GrammarCompiler
    return GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
