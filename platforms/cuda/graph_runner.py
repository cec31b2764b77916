"""Decode steps recorded as CUDA graphs (HIP graphs on ROCm, through the same torch API).

For each capture size (1, 2, 4, 8, 16, 24 … up to the scheduler's batch limit) one graph is
recorded over static buffers: input ids, positions and the attention metadata's tensors. A step
whose requests are all decodes and whose batch fits the largest graph is copied into the buffers
of the smallest graph that holds it, the tail padded (token 0 at position 0, KV slot -1 so nothing
is written, sequence length 0 so nothing is read), and the graph is replayed; anything else
(prefill chunks, bigger batches) runs eagerly. The recorded kernels read the metadata's tensors
only, which is what `AttentionBackend.graph_capturable` promises; with a backend that does not,
the runner stays eager.
"""
from __future__ import annotations

import bisect
import logging
from typing import Any, Callable

import torch

from runtime.attention_backends.base import AttentionMetadata
from runtime.plugins.interfaces import CaptureSpec, GraphRunner

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(limit: int) -> list[int]:
    """The batch sizes to record: 1, 2, 4, then every multiple of 8, up to and with `limit`."""
    limit = min(limit, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s < limit] + list(range(8, limit, 8))
    return sorted({*sizes, limit})


def replay_size(sizes: list[int], num_tokens: int, metadata: AttentionMetadata) -> int | None:
    """The recorded batch size a step replays, or None when it must run eagerly."""
    if metadata.max_query_len != 1 or metadata.num_reqs != num_tokens or not sizes:
        return None  # prefill chunks are in the batch
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


class CudaGraphRunner(GraphRunner):
    name = "cuda graphs"

    def __init__(self, name: str = "cuda graphs") -> None:
        self.name = name
        self.sizes: list[int] = []
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self, forward: Callable[..., torch.Tensor], spec: CaptureSpec) -> None:
        self._forward = forward
        backend = spec.attention_backend
        if not backend.graph_capturable:
            logger.info("attention backend %s cannot be recorded: running eagerly", backend.name)
            self.name = f"eager ({backend.name} cannot be recorded as graphs)"
            return
        self.spec = spec
        self.sizes = capture_sizes(min(spec.max_num_seqs, spec.max_num_batched_tokens))
        largest, dev = self.sizes[-1], spec.device
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(largest, spec.max_blocks_per_seq, dtype=torch.int32,
                                        device=dev)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
                inputs = {"input_ids": self.input_ids[:bs], "positions": self.positions[:bs]}
                with spec.forward_context(self._static_metadata(bs)):
                    self._forward(**inputs)  # compile kernels and warm allocators outside capture
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._forward(**inputs)
                self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()
        logger.info("recorded %d decode graphs for batch sizes up to %d", len(self.sizes), largest)

    def _static_metadata(self, bs: int) -> AttentionMetadata:
        max_len = self.spec.max_model_len
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[max_len] * bs,
            max_query_len=1, max_seq_len=max_len, num_decode_tokens=bs)

    def run(self, **inputs: Any) -> torch.Tensor:
        input_ids, positions = inputs["input_ids"], inputs["positions"]
        n = input_ids.numel()
        md = self.spec.current_metadata() if self.graphs else None
        bs = replay_size(self.sizes, n, md) if md is not None else None
        if bs is None:
            return self._forward(**inputs)
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:bs].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:bs].zero_()
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.seq_lens[n:bs].zero_()
        self.block_tables[:n, :md.block_tables.size(1)].copy_(md.block_tables)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]
