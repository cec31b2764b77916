"""`lora_shrink` / `lora_expand` in portable torch: the reference every platform kernel must
match, and what runs when no plugin answers the `runtime_custom_op` hook for them.

Tokens are grouped by adapter slot once per step (`LoRABatch.groups`, the segments of punica's
SGMV); each group multiplies by its slot's matrices, tokens without an adapter are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRABatch:
    token_slots: torch.Tensor  # [tokens] int64: each token's adapter slot, -1 for the base
    groups: list[tuple[int, torch.Tensor]]  # (slot, indices of its tokens), slots >= 0 only


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """x [tokens, in], a [slots, slices, rank, in] -> [slices, tokens, rank] in a's dtype:
    x @ A[slot].T per slice, zero for tokens without an adapter."""
    out = a.new_zeros(a.size(1), x.size(0), a.size(2))
    for slot, rows in batch.groups:
        # [tokens, in] @ [in, slices * rank], one matmul for every slice
        part = x[rows].to(a.dtype) @ a[slot].flatten(0, 1).T
        out.index_copy_(1, rows, part.view(-1, a.size(1), a.size(2)).transpose(0, 1))
    return out


def lora_expand(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
                offsets: list[int]) -> torch.Tensor:
    """Add buf[s] @ B[slot][offsets[s]:offsets[s + 1]].T into y's columns of slice s, for every
    token with an adapter; y [tokens, out] in place, b [slots, out, rank], buf from shrink."""
    for slot, rows in batch.groups:
        delta = torch.cat([buf[s, rows] @ b[slot, offsets[s]:offsets[s + 1]].T
                           for s in range(buf.size(0))], dim=1)
        y.index_add_(0, rows, delta.to(y.dtype))
    return y
