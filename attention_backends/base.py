"""The attention-backend interface: attention over a paged (block-table) KV cache.

A step's batch is flat: the new tokens of every scheduled request are concatenated, prefill chunks
and decodes alike. Request i owns tokens `query_start_loc[i]:query_start_loc[i+1]` of the batch; its
context after this step is `seq_lens[i]` tokens, the last `query_lens[i]` of which are new, so a new
token at offset j of request i sits at position `seq_lens[i] - query_lens[i] + j`. Request i's KV lives
in the blocks `block_tables[i, :ceil(seq_lens[i] / block_size)]`; `slot_mapping[t]` is the flat slot
(`block * block_size + offset`) where token t's K and V are written.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch reads and writes the KV cache. Built once per step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, on the device
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_reqs] int32, on the device
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on the device
    query_start_loc_cpu: list[int]  # host copies, for backends that loop or bucket on the host
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    num_decode_tokens: int = 0  # requests with query_len 1 come first: tokens [0, num_decodes)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """One attention layer's kernel over the paged KV cache.

    A backend class is chosen once per engine through the `runtime_attention_backend` hook, then
    instantiated once per attention layer.
    """

    name: str = ""
    # Which dimension of `kv_cache_shape` indexes blocks (the runner zeroes blocks on first use).
    kv_cache_block_dim: int = 1
    # Whether a decode step can be recorded as a device graph: the backend reads the metadata's
    # tensors only (never its host lists, which are frozen at capture) and skips slots < 0.
    graph_capturable: bool = False
    # Whether the backend applies `logits_soft_cap` (Gemma 2's attention soft-capping).
    supports_logits_soft_cap: bool = False

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 sliding_window: int | None, device_type: str) -> tuple[bool, str]:
        """Whether this backend can run the given layer shape here, and if not, why."""
        return True, ""

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor; dimension 0 indexes K (0) and V (1)."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        """`logits_soft_cap`: scores become `cap * tanh(scores / cap)` before the softmax
        (Gemma 2); a backend without `supports_logits_soft_cap` refuses it."""
        if logits_soft_cap is not None and not self.supports_logits_soft_cap:
            raise ValueError(f"attention backend {self.name} has no logit soft-capping, which "
                             f"this model needs; torch_paged and cpu_paged have it")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Write this step's K/V into `kv_cache` at `metadata.slot_mapping`, then attend.

        query [num_tokens, num_heads, head_size]; key/value [num_tokens, num_kv_heads, head_size].
        Each token attends causally to its own request's context (and only the last
        `sliding_window` positions, when set). Returns [num_tokens, num_heads, head_size].
        """
