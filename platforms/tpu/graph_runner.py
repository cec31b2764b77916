"""XLA execution with bucketed shapes: every step is padded to a bucket so graphs are reused.

XLA traces the forward lazily and compiles one graph per distinct set of input shapes. Each step
is padded to the next bucket of token count (powers of two from 16), request count, longest
query and longest context (powers of two), with the block table at its full width, so a server
compiles a few dozen graphs once instead of one per batch. Padding tokens sit at position 0 with
KV slot -1 (the backend writes them to a scratch block); padding requests have no query and no
context.
After the forward, the graph is cut (`torch_xla.sync`) so it is compiled and cached on its own.
The padding itself is plain torch, so the tests run this runner on the CPU.
"""
from __future__ import annotations

import bisect
from typing import Any, Callable

import torch
import torch.nn.functional as F

from runtime.attention_backends.base import AttentionMetadata
from runtime.plugins.interfaces import CaptureSpec, GraphRunner

MIN_TOKEN_BUCKET = 16


def buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from `smallest`, the last one capped at `largest`."""
    sizes, n = [], smallest
    while n < largest:
        sizes.append(n)
        n *= 2
    return sizes + [largest]


def bucket(sizes: list[int], n: int) -> int:
    """The smallest bucket holding n."""
    return sizes[bisect.bisect_left(sizes, n)]


def pad_metadata(md: AttentionMetadata, num_tokens: int, num_reqs: int, max_query_len: int,
                 table_width: int, max_seq_len: int) -> AttentionMetadata:
    """`md` padded to the given shape: padding slots -1, padding requests empty."""
    n, r = md.slot_mapping.numel(), md.num_reqs
    last = md.query_start_loc_cpu[-1]
    return AttentionMetadata(
        slot_mapping=F.pad(md.slot_mapping, (0, num_tokens - n), value=-1),
        query_start_loc=F.pad(md.query_start_loc, (0, num_reqs - r), value=last),
        seq_lens=F.pad(md.seq_lens, (0, num_reqs - r)),
        block_tables=F.pad(md.block_tables, (0, table_width - md.block_tables.size(1),
                                             0, num_reqs - r)),
        query_start_loc_cpu=md.query_start_loc_cpu + [last] * (num_reqs - r),
        seq_lens_cpu=md.seq_lens_cpu + [0] * (num_reqs - r),
        max_query_len=max_query_len, max_seq_len=max_seq_len,
        num_decode_tokens=md.num_decode_tokens)


def _graph_cut() -> Callable[[], None]:
    try:
        import torch_xla
    except ImportError:  # the CPU tests run the padding without XLA
        return lambda: None
    return torch_xla.sync


class XlaGraphRunner(GraphRunner):
    name = "xla (bucketed shapes)"

    def capture(self, forward: Callable[..., torch.Tensor], spec: CaptureSpec) -> None:
        self._forward = forward
        self.spec = spec
        self.token_buckets = buckets(MIN_TOKEN_BUCKET, spec.max_num_batched_tokens)
        self.req_buckets = buckets(1, spec.max_num_seqs)
        self.query_buckets = buckets(1, spec.max_num_batched_tokens)
        self.context_buckets = buckets(1, spec.max_model_len)
        self.sync = _graph_cut()

    def run(self, **inputs: Any) -> torch.Tensor:
        input_ids, positions = inputs["input_ids"], inputs["positions"]
        md = self.spec.current_metadata()
        n = input_ids.numel()
        num_tokens = bucket(self.token_buckets, n)
        padded = pad_metadata(md, num_tokens, bucket(self.req_buckets, md.num_reqs),
                              bucket(self.query_buckets, md.max_query_len),
                              self.spec.max_blocks_per_seq,
                              bucket(self.context_buckets, md.max_seq_len))
        with self.spec.forward_context(padded):
            out = self._forward(input_ids=F.pad(input_ids, (0, num_tokens - n)),
                                positions=F.pad(positions, (0, num_tokens - n)))
        self.sync()
        return out[:n]
