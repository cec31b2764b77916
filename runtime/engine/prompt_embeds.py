"""Prompts given as embeddings (`enable_prompt_embeds`): a [tokens, hidden size] tensor that
takes the place of the prompt's token embeddings, as vLLM's `{"prompt_embeds": tensor}`.

The request keeps one placeholder token id per row, so the scheduler, the KV cache and the
budgets count it like any prompt; the workers put the rows in at the prompt's positions, and
the prefix cache keys its blocks by a digest of the rows (`digest`), never by the placeholders.
"""
from __future__ import annotations

import torch

from runtime.multimodal.inputs import TensorData
from runtime.multimodal.wire import EMBEDDING_DTYPES

PLACEHOLDER_TOKEN_ID = 0  # the prompt positions' token id: never embedded, never sampled from
FLAG = "enable_prompt_embeds=True (--enable-prompt-embeds)"


def check_prompt_embeds(tensor: object, hidden_size: int, max_model_len: int) -> TensorData:
    """The embeddings as a request carries them, or ValueError naming what is wrong: a
    float32, bfloat16 or float16 tensor of [tokens, hidden_size] ([1, tokens, hidden_size] is
    taken too), at least one token and fewer than max_model_len, every value finite."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in EMBEDDING_DTYPES:
        raise ValueError(f"prompt_embeds must be float32, bfloat16 or float16, got "
                         f"{str(tensor.dtype).removeprefix('torch.')}")
    if tensor.dim() == 3 and tensor.size(0) == 1:
        tensor = tensor[0]
    if tensor.dim() != 2:
        raise ValueError(f"prompt_embeds must be 2-D [tokens, hidden size {hidden_size}], "
                         f"got shape {list(tensor.shape)}")
    if tensor.size(1) != hidden_size:
        raise ValueError(f"prompt_embeds rows must have the model's hidden size {hidden_size}, "
                         f"got {tensor.size(1)}")
    if tensor.size(0) == 0:
        raise ValueError("prompt_embeds is empty: it must hold at least one token")
    if tensor.size(0) >= max_model_len:
        raise ValueError(f"prompt_embeds holds {tensor.size(0)} tokens, but the model's "
                         f"context (max_model_len) is {max_model_len} tokens, which must hold "
                         "the prompt and at least one generated token")
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError("prompt_embeds holds values that are not finite (nan or inf)")
    return TensorData.of(tensor)
