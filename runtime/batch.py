"""The flat batch a step's requests make: token ids, positions and the attention metadata
(the paged cache's slot of every new token, block tables, query starts, sequence lengths;
a hybrid model's state slots).

Built in numpy on the host and moved to the device once. The model runner, a draft model and
a decoder pooling model all build their steps here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from runtime.attention_backends.base import AttentionMetadata
from runtime.attention_backends.context_parallel import ContextParallel

if TYPE_CHECKING:
    from runtime.core.messages import ScheduledRequest


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T] on the device
    positions: torch.Tensor  # [T] on the device
    metadata: AttentionMetadata
    # [R + 1] int64 on the host: request i's tokens are rows [cu[i], cu[i + 1])
    query_start_loc: np.ndarray
    query_lens: np.ndarray  # [R] int64 on the host

    @property
    def last_rows(self) -> np.ndarray:
        """The row of each request's last token."""
        return self.query_start_loc[1:] - 1


def build_batch(reqs: list[ScheduledRequest], block_size: int, device: torch.device,
                dcp: ContextParallel | None = None) -> Batch:
    """The batch of `reqs`, in their order (a runner puts decodes first: backends batch them).
    Under decode context parallel (`dcp`), the slots are this rank's (-1 for tokens another
    rank keeps) and each table block holds `block_size` tokens of this rank's shard."""
    query_lens = np.array([len(r.token_ids) for r in reqs], dtype=np.int64)
    starts = np.array([r.start_pos for r in reqs], dtype=np.int64)
    seq_lens = starts + query_lens
    cu = np.zeros(len(reqs) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    input_ids = np.fromiter((t for r in reqs for t in r.token_ids), np.int64, int(cu[-1]))
    # position of every token: its request's start + its offset within the request
    positions = np.repeat(starts - cu[:-1], query_lens) + np.arange(cu[-1])
    max_blocks = max(len(r.block_ids) for r in reqs)
    block_tables = np.zeros((len(reqs), max_blocks), dtype=np.int32)
    for i, r in enumerate(reqs):
        block_tables[i, :len(r.block_ids)] = r.block_ids
    req_of_token = np.repeat(np.arange(len(reqs)), query_lens)
    local = positions if dcp is None else dcp.local_index(positions)
    slots = (block_tables[req_of_token, local // block_size].astype(np.int64) * block_size
             + local % block_size)
    if dcp is not None:
        slots[dcp.owner(positions) != dcp.rank] = -1
    metadata = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(block_tables).to(device),
        query_start_loc_cpu=cu.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        num_decode_tokens=int(np.argmax(query_lens > 1)) if (query_lens > 1).any()
        else len(reqs),
        dcp=dcp,
    )
    if reqs[0].state_slot is not None:
        metadata.state_indices = torch.tensor([r.state_slot for r in reqs], device=device)
        metadata.has_initial_state = torch.from_numpy(starts > 0).to(device)
        _checkpoints(metadata, reqs, cu, device)
    return Batch(torch.from_numpy(input_ids).to(device), torch.from_numpy(positions).to(device),
                 metadata, cu, query_lens)


def _checkpoints(metadata: AttentionMetadata, reqs: list[ScheduledRequest], cu: np.ndarray,
                 device: torch.device) -> None:
    """The rows after which the step checkpoints a recurrent state, and their store entries."""
    orders = sorted((int(cu[i]) + pos - r.start_pos, entry)
                    for i, r in enumerate(reqs) for pos, entry in r.checkpoints)
    if not orders:
        return
    metadata.checkpoint_rows = torch.tensor([row for row, _ in orders], device=device)
    metadata.checkpoint_ids = torch.tensor([entry for _, entry in orders])
    metadata.num_decode_checkpoints = sum(row < metadata.num_decode_tokens for row, _ in orders)
