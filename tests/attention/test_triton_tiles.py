"""The Triton attention kernel's shapes: the tile picked from a device's shared memory per
block (the documented limits of sm80, sm90 and gfx942), the split-KV decode chosen for small
batches, and both paths against the portable backend under Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from runtime.attention_backends import triton_ops  # noqa: E402
from runtime.attention_backends.torch_paged import TorchPagedAttention  # noqa: E402
from runtime.attention_backends.triton_ops import (  # noqa: E402
    attention_tile, decode_splits, tile_shared_bytes)
from runtime.attention_backends.triton_paged import TritonPagedAttention  # noqa: E402
from runtime.testing.paged_batch import build_layer, make_batch, run_two_steps  # noqa: E402

# shared memory one block may use: CUDA's sharedMemPerBlockOptin (A100, H100), MI300's LDS
SM80, SM90, GFX942 = 166_912, 232_448, 65_536
BF16, FP32 = torch.bfloat16, torch.float32
needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not triton.knobs.runtime.interpret,
    reason="runs the kernels through Triton's interpreter (TRITON_INTERPRET=1), no GPU")


def test_estimate_covers_what_triton_allocates():
    """The 64-row prefill tile's bytes as Triton compiles it (tests/device/shared_memory.py,
    sm86) are below the estimate; both are above MI300's LDS."""
    for head, dtype, measured in ((256, BF16, 69_888), (128, FP32, 74_240)):
        assert measured <= tile_shared_bytes(64, 32, head, dtype) <= measured + 2048
        assert measured > GFX942


@pytest.mark.parametrize("limit,name", [(SM80, "sm80"), (SM90, "sm90")])
def test_nvidia_keeps_the_largest_tiles(limit, name):
    for head in (64, 128, 256):
        for dtype in (torch.float16, BF16, FP32):
            assert attention_tile(True, 1, head, dtype, limit) == (64, 32), (name, head, dtype)
            assert attention_tile(False, 1, head, dtype, limit) == (16, 32), (name, head, dtype)


def test_mi300_takes_smaller_tiles_where_the_large_ones_overflow_its_lds():
    assert attention_tile(True, 1, 128, BF16, GFX942) == (64, 32)  # 51 KiB: fits
    assert attention_tile(True, 1, 256, BF16, GFX942) == (32, 32)
    assert attention_tile(True, 1, 128, FP32, GFX942) == (32, 32)
    assert attention_tile(True, 1, 256, FP32, GFX942) == (16, 16)
    assert attention_tile(False, 1, 256, FP32, GFX942) == (16, 16)
    # a GQA group of 4 packs 4 heads per token: 64 rows are 16 tokens, 32 rows 8
    assert attention_tile(True, 4, 256, BF16, GFX942) == (8, 32)
    for head in (64, 128, 256):
        for dtype in (torch.float16, BF16, FP32):
            for prefill in (True, False):
                block_m, kv_tile = attention_tile(prefill, 2, head, dtype, GFX942)
                assert tile_shared_bytes(block_m * 2, kv_tile, head, dtype) <= GFX942


def test_decode_splits_fill_the_device_only_when_the_batch_does_not():
    assert decode_splits(1, 8, 4096, 132) == (16, 256)  # 8 programs: 16 pieces of 256
    assert decode_splits(1, 8, 32768, 132) == (17, 1952)  # enough pieces to cover 132 SMs
    assert decode_splits(4, 2, 600, 132) == (2, 320)  # pieces of at least MIN_SPLIT_LEN
    assert decode_splits(4, 2, 600, 132, kv_tile=16) == (2, 304)  # whole K/V tiles
    assert decode_splits(1, 8, 300, 132) == (1, 0)  # too short to split
    assert decode_splits(64, 8, 32768, 132) == (1, 0)  # 512 programs cover the device


# decode-only batches with contexts long enough to split (2 KV heads: 2 x 3 programs)
LONG_DECODES = ([1, 1, 1], [1, 500, 800])


@pytest.fixture
def merges(monkeypatch) -> list[tuple[int, int]]:
    """The grid of every merge of split decodes."""
    grids: list[tuple[int, int]] = []
    merge = triton_ops._merge_splits_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return merge[grid]

    monkeypatch.setattr(triton_ops, "_merge_splits_kernel", Spy())
    return grids


@needs_interpreter
@pytest.mark.parametrize("window", [None, 100])
def test_split_decode_matches_the_portable_backend(merges, window):
    shape = (*LONG_DECODES, 16, 4, 2, 32)
    got = run_two_steps(TritonPagedAttention, *shape, FP32, "cpu", sliding_window=window)
    want = run_two_steps(TorchPagedAttention, *shape, FP32, "cpu", sliding_window=window)
    assert merges == [(3, 4)]  # step 2 (the decodes) was split: 3 tokens x 4 heads merged
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


@needs_interpreter
def test_split_decode_over_an_fp8_cache(merges):
    query, key, value, cache, metadata = make_batch(*LONG_DECODES, 16, 4, 2, 32)
    cache = cache.to(torch.float8_e4m3fn)
    outs = []
    for cls in (TritonPagedAttention, TorchPagedAttention):
        layer = build_layer(cls, "cpu", 4, 32, 32 ** -0.5, 2)
        layer.set_kv_scales(0.02, 0.05)
        outs.append(layer.forward(query, key, value, cache.clone(), metadata))
    assert merges == [(3, 4)]
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)


@needs_interpreter
def test_smallest_tiles_match_the_portable_backend(monkeypatch):
    """With a device whose shared memory takes only the smallest tile (16 x 16)."""
    monkeypatch.setattr(triton_ops, "device_limits", lambda index: (12_000, 132))
    assert attention_tile(True, 2, 32, FP32, 12_000) == (8, 16)
    shape = ([1, 1, 5, 40], [9, 33, 5, 70], 8, 4, 2, 32)
    got = run_two_steps(TritonPagedAttention, *shape, FP32, "cpu")
    want = run_two_steps(TorchPagedAttention, *shape, FP32, "cpu")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
