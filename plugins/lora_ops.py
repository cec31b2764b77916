"""`lora_shrink` / `lora_expand` in portable torch: the reference every platform kernel must
match, and what runs when no plugin answers the `runtime_custom_op` hook for them.

The step's tokens are grouped by adapter slot once per step (`LoRABatch.build`: the segments of
punica's SGMV), and every LoRA layer of the step reuses the grouping; each group multiplies by
its slot's matrices, tokens without an adapter are skipped. The products are summed in float32
whatever the weights' dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRABatch:
    token_slots: torch.Tensor  # [tokens] int64: each token's adapter slot, -1 for the base
    token_indices: torch.Tensor  # [n] int64: the tokens with an adapter, grouped by slot
    seg_starts: torch.Tensor  # [segments + 1] int64: each slot's run in token_indices
    seg_slots: torch.Tensor  # [segments] int64: the slot of each run
    groups: list[tuple[int, torch.Tensor]]  # (slot, its tokens): the runs, slots >= 0 only

    @classmethod
    def build(cls, token_slots: torch.Tensor) -> LoRABatch:
        """Group the tokens by slot (a stable sort: each run keeps the tokens' order)."""
        order = torch.argsort(token_slots, stable=True)
        slots, counts = torch.unique_consecutive(token_slots[order], return_counts=True)
        slots, counts = slots.tolist(), counts.tolist()
        skip = counts[0] if slots and slots[0] < 0 else 0
        if skip:
            slots, counts = slots[1:], counts[1:]
        token_indices = order[skip:]
        bounds = [0]
        for count in counts:
            bounds.append(bounds[-1] + count)
        groups = [(slot, token_indices[lo:hi]) for slot, lo, hi in zip(slots, bounds, bounds[1:])]
        device = token_slots.device
        return cls(token_slots, token_indices, torch.tensor(bounds, device=device),
                   torch.tensor(slots, dtype=torch.int64, device=device), groups)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """x [tokens, in], a [slots, slices, rank, in] -> [slices, tokens, rank] float32:
    x @ A[slot].T per slice, zero for tokens without an adapter."""
    out = torch.zeros(a.size(1), x.size(0), a.size(2), dtype=torch.float32, device=x.device)
    for slot, rows in batch.groups:
        # [tokens, in] @ [in, slices * rank], one matmul for every slice
        part = x[rows].float() @ a[slot].flatten(0, 1).float().T
        out.index_copy_(1, rows, part.view(-1, a.size(1), a.size(2)).transpose(0, 1))
    return out


def lora_expand(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
                offsets: list[int]) -> torch.Tensor:
    """Add buf[s] @ B[slot][offsets[s]:offsets[s + 1]].T into y's columns of slice s, for every
    token with an adapter, rounding once to y's dtype; y [tokens, out] in place, b [slots, out,
    rank] (any strides), buf from shrink."""
    for slot, rows in batch.groups:
        delta = torch.cat([buf[s, rows].float() @ b[slot, offsets[s]:offsets[s + 1]].float().T
                           for s in range(buf.size(0))], dim=1)
        y.index_copy_(0, rows, (y[rows].float() + delta).to(y.dtype))
    return y
