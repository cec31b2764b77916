"""The CUDA platform's `fused_moe` (Triton, under TRITON_INTERPRET=1 without a GPU; the device
run in tests/device/test_moe_gpu.py compiles it) against the portable op, and its block
alignment. The interpreter's tl.dot has no bf16, so bf16 is checked on the GPU only."""
from __future__ import annotations

import pytest
import torch

from runtime.layers.build_context import BuildContext
from runtime.layers.fused_moe import FusedMoE, naive_moe
from runtime.platforms.cuda.fused_moe_triton import fused_moe, moe_align_block_size
from runtime.platforms.cuda.platform import CudaPlatform, GpuDevice
from runtime.plugins import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_case(seed: int, tokens: int, hidden: int, inter: int, experts: int, top_k: int,
                dtype: torch.dtype, device: str = DEVICE):
    """(x, w13, w2, topk_weights, topk_ids), scaled so activations stay near 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = torch.softmax(torch.randn(tokens, experts, generator=g), -1).topk(top_k, -1)
    return (x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype), weights.to(device),
            ids.to(device))


def check(case: tuple, dtype: torch.dtype) -> None:
    """The kernel in `dtype` against the portable op in float32 on the same rounded inputs."""
    x, w13, w2, weights, ids = case
    want = ops.fused_moe(x.float().cpu(), w13.float().cpu(), w2.float().cpu(), weights.cpu(),
                         ids.cpu())
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)


# (tokens, hidden, intermediate, experts, top_k): one decode token; sizes off the 32/64 tiles;
# enough pairs for 64-row blocks; top-1 routing
SHAPES = [(1, 32, 32, 4, 2), (7, 48, 40, 4, 2), (150, 32, 24, 2, 2), (9, 64, 16, 8, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_fused_moe_matches_the_portable_op(shape, dtype):
    check(random_case(0, *shape, dtype), dtype)


def test_the_cuda_platform_answers_fused_moe_with_the_kernel():
    platform = CudaPlatform([GpuDevice(0, "H100", (9, 0), 80 << 30)])
    assert platform.custom_op("fused_moe") is fused_moe


def test_ids_of_experts_on_other_ranks_add_nothing():
    """Expert parallel hands in -1 for experts another rank holds; a token may have none here."""
    x, w13, w2, weights, ids = random_case(1, 6, 32, 32, 4, 2, torch.float32)
    ids = torch.where(ids >= 2, -1, ids)
    ids[0] = -1
    got = fused_moe(x, w13, w2, weights, ids)
    assert got[0].abs().max() == 0
    check((x, w13, w2, weights, ids), torch.float32)


def test_align_groups_pairs_by_expert_in_padded_blocks():
    ids = torch.tensor([[2, 0], [2, -1], [0, 2], [3, 2]])
    sorted_ids, expert_ids = moe_align_block_size(ids, 4, 4)
    flat = ids.flatten()
    blocks = sorted_ids.view(-1, 4)
    assert blocks.size(0) == expert_ids.numel()
    seen = []
    for block, expert in zip(blocks.tolist(), expert_ids.tolist()):
        pairs = [p for p in block if p < flat.numel()]
        if expert < 0:
            assert not pairs
        assert all(flat[p] == expert for p in pairs)
        seen += pairs
    assert sorted(seen) == [i for i, e in enumerate(flat.tolist()) if e >= 0]
    assert expert_ids.tolist()[:3] == [0, 2, 3]  # expert 2's four pairs fill one block


def test_the_naive_benchmark_baseline_computes_the_same():
    x, w13, w2, weights, ids = random_case(2, 11, 32, 24, 4, 2, torch.float32, "cpu")
    ids[3, 1] = -1
    torch.testing.assert_close(naive_moe(x, w13, w2, weights, ids),
                               ops.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_runtime_moe_impl_picks_the_op(monkeypatch):
    ctx = BuildContext(dtype=torch.float32, device=torch.device("cpu"), attention_backend=None)
    assert FusedMoE(4, 2, 8, 8, True, ctx).op is ops.fused_moe
    monkeypatch.setenv("RUNTIME_MOE_IMPL", "naive")
    assert FusedMoE(4, 2, 8, 8, True, ctx).op is naive_moe
    monkeypatch.setenv("RUNTIME_MOE_IMPL", "loop")
    with pytest.raises(ValueError, match="RUNTIME_MOE_IMPL must be 'fused' or 'naive'"):
        FusedMoE(4, 2, 8, 8, True, ctx)
