"""`PoolingParams`: what a pooling request asks for, with vLLM's names."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "token_embed")


@dataclass
class PoolingParams:
    """`dimensions`: keep the first n dimensions of an embedding (Matryoshka), then normalise;
    `normalize`: None follows the model's pooler config (sentence-transformers' Normalize);
    `truncate_prompt_tokens`: keep the last k tokens of a longer prompt (-1: the model's
    limit); without it a prompt over the limit is refused.

    The engine sets `task` (what the runner returns: the pooled vector, the label logits, or
    every token's hidden state) and, for a cross-encoder's text pair, `token_type_ids` (the
    segment of each prompt token)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None
    token_type_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.truncate_prompt_tokens is not None and not (
                self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1):
            raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, "
                             f"got {self.truncate_prompt_tokens}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, "
                             f"got {self.task!r}")
