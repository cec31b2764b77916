"""How close the Triton decode kernel comes to the GPU's memory bandwidth (printed, never
asserted). Decode reads each request's whole K/V once, so bytes read / time against a plain
device copy says whether the grid leaves the GPU idle: small batches with long contexts run the
split-KV path (`triton_ops.decode_splits` pieces per context, printed), large ones one program
per request and KV head.
"""
import time

import torch

from runtime.attention_backends.base import AttentionMetadata
from runtime.attention_backends.triton_ops import decode_splits, device_limits
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.testing.paged_batch import build_layer

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
ITERS = 20


def seconds_per_call(fn) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(ITERS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / ITERS


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.nbytes / seconds_per_call(lambda: dst.copy_(src))


def decode_bandwidth(batch: int, context: int) -> tuple[float, float]:
    blocks_per_req = context // BLOCK_SIZE
    cache = torch.randn(2, batch * blocks_per_req, BLOCK_SIZE, KV_HEADS, HEAD_SIZE,
                        dtype=torch.bfloat16, device="cuda")
    query = torch.randn(batch, HEADS, HEAD_SIZE, dtype=torch.bfloat16, device="cuda")
    key = value = torch.zeros(batch, KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device="cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    metadata = AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device="cuda"),  # no writes
        query_start_loc=torch.arange(batch + 1, **i32),
        seq_lens=torch.full((batch,), context, **i32),
        block_tables=torch.arange(batch * blocks_per_req, **i32).view(batch, blocks_per_req),
        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[context] * batch,
        max_query_len=1, max_seq_len=context, num_decode_tokens=batch)
    layer = build_layer(TritonPagedAttention, "cuda", HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5,
                        KV_HEADS)
    t = seconds_per_call(lambda: layer.forward(query, key, value, cache, metadata))
    return t, cache.nbytes / t


def main() -> None:
    peak = copy_bandwidth()
    print(f"device copy: {peak / 1e9:,.0f} GB/s; decode, {HEADS} heads / {KV_HEADS} KV heads "
          f"of {HEAD_SIZE}, bf16, block size {BLOCK_SIZE}:")
    for batch in (1, 8, 64):
        for context in (4096, 32768):
            t, bw = decode_bandwidth(batch, context)
            splits, _ = decode_splits(batch, KV_HEADS, context, device_limits(0)[1])
            print(f"  batch {batch:>2} x {context:>5} tokens ({splits:>2} pieces): "
                  f"{t * 1e6:8.1f} us/layer, {bw / 1e9:7,.0f} GB/s = {bw / peak:4.0%} of the copy")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
