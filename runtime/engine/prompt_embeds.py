"""Prompts given as embeddings (`enable_prompt_embeds`): a [tokens, hidden size] tensor that
takes the place of the prompt's token embeddings, as vLLM's `{"prompt_embeds": tensor}`.

The request keeps one placeholder token id per row, so the scheduler, the KV cache and the
budgets count it like any prompt; the workers put the rows in at the prompt's positions, and
the prefix cache keys its blocks by a digest of the rows (`digest`), never by the placeholders.
"""
from __future__ import annotations

import base64
import binascii
import io

import torch

from runtime.multimodal.inputs import TensorData

PLACEHOLDER_TOKEN_ID = 0  # the prompt positions' token id: never embedded, never sampled from
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLAG = "enable_prompt_embeds=True (--enable-prompt-embeds)"


def decode_prompt_embeds(encoded: str | bytes, name: str = "prompt_embeds") -> torch.Tensor:
    """vLLM's wire format: base64 of a `torch.save`d tensor, read with `weights_only` (no
    code runs) on the CPU, sparse layouts checked for out-of-range indices, made dense.
    `name`: the field an error names."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name} must be base64 of a torch.save()d tensor: "
                         "the base64 does not decode") from None
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to_dense()
    except Exception as e:  # torch.load raises many kinds for a malformed file
        raise ValueError(f"{name} must be base64 of a torch.save()d tensor: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                         ) from None
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must hold a tensor, got {type(tensor).__name__}")
    return tensor


def check_prompt_embeds(tensor: object, hidden_size: int, max_model_len: int) -> TensorData:
    """The embeddings as a request carries them, or ValueError naming what is wrong: a
    float32, bfloat16 or float16 tensor of [tokens, hidden_size] ([1, tokens, hidden_size] is
    taken too), at least one token and fewer than max_model_len, every value finite."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPES:
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
