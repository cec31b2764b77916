"""Tensors as the API receives them, in vLLM's wire format: base64 of a `torch.save`d tensor
(`prompt_embeds`, `image_embeds`)."""
from __future__ import annotations

import base64
import binascii
import io

import torch

EMBEDDING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what embeddings may be


def decode_tensor(encoded: str | bytes, name: str) -> torch.Tensor:
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
