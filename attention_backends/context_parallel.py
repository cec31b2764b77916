"""Decode context parallel (DCP): which rank of the group keeps each token's KV, where in its
shard it sits, and the exact merge of the ranks' partial attention outputs.

The tokens of every sequence are dealt to the `world_size` ranks of the DCP group in runs of
`interleave` positions: position p belongs to rank `(p // interleave) % world_size`. A rank
keeps its positions in order, so its shard is contiguous: the j-th token it holds is its
*local index* j, stored at slot `block_tables[j // block_size] * block_size + j % block_size`
of its own cache. The scheduler sees blocks of `block_size * world_size` tokens; block i of a
request's table is block i of every rank's cache, holding that rank's share of the block.

Each rank attends every query of the group over its shard alone and returns the output with
its log-sum-exp (LSE); `merge_attn_states` weights the partials by `exp(lse_r - lse)`, where
`lse` is the log-sum-exp of the ranks' LSEs, which gives attention over the whole context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its DCP group, and the interleave rule. Its methods take torch
    tensors or numpy arrays of positions alike (`local_len`: tensors)."""

    rank: int = 0
    world_size: int = 1
    interleave: int = 1

    def owner(self, positions: torch.Tensor) -> torch.Tensor:
        """The rank holding each position's KV."""
        return positions // self.interleave % self.world_size

    def local_index(self, positions: torch.Tensor) -> torch.Tensor:
        """Each position's index in its owner's shard."""
        i, n = self.interleave, self.world_size
        return positions // (i * n) * i + positions % i

    def positions(self, local: torch.Tensor) -> torch.Tensor:
        """The positions of this rank's local indices `local`."""
        i, n = self.interleave, self.world_size
        return local // i * (i * n) + self.rank * i + local % i

    def local_len(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """How many of the first `seq_lens` positions this rank holds."""
        i, n = self.interleave, self.world_size
        return seq_lens // (i * n) * i + (seq_lens % (i * n) - self.rank * i).clamp(0, i)


def merge_attn_states(outputs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The attention over the union of disjoint key sets from the attention over each:
    `outputs` [P, ..., D] and their float32 `lses` [P, ...] (-inf where a part saw no key)."""
    weights = merged_weights(lses)
    return (outputs.float() * weights.unsqueeze(-1)).sum(0).to(outputs.dtype)


def merged_weights(lses: torch.Tensor) -> torch.Tensor:
    """Each part's share `exp(lse_p - logsumexp_p(lse_p))` of the merged output; a part with
    no key gets 0 (every query sees at least one key in some part)."""
    return torch.exp(lses - torch.logsumexp(lses, 0, keepdim=True))
