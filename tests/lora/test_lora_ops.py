"""lora_shrink / lora_expand: tokens of different slots (and none) in one call give each token
its own adapter's x @ A.T @ B.T, slice by slice; the CPU and Triton kernels match the torch
reference."""
from __future__ import annotations

import pytest
import torch

from runtime.plugins.lora_ops import LoRABatch, lora_expand, lora_shrink


def random_case(seed: int, num_slots: int, rank: int, d_in: int, sizes: list[int],
                token_slots: list[int], dtype: torch.dtype = torch.float32):
    """(x, y, a, b, batch, offsets) for a layer of `sizes` output slices; b is stored
    [slots, rank, out] as the LoRA layers hold it."""
    torch.manual_seed(seed)
    batch = LoRABatch.build(torch.tensor(token_slots, dtype=torch.int64))
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    tokens = len(token_slots)
    return (torch.randn(tokens, d_in).to(dtype), torch.randn(tokens, sum(sizes)).to(dtype),
            torch.randn(num_slots, len(sizes), rank, d_in).to(dtype),
            torch.randn(num_slots, rank, sum(sizes)).to(dtype).transpose(1, 2), batch, offsets)


def test_batch_groups_tokens_by_slot():
    batch = LoRABatch.build(torch.tensor([2, -1, 0, 2, 1, -1, 0]))
    assert batch.token_indices.tolist() == [2, 6, 4, 0, 3]
    assert batch.seg_starts.tolist() == [0, 2, 3, 5] and batch.seg_slots.tolist() == [0, 1, 2]
    assert [(s, rows.tolist()) for s, rows in batch.groups] == [(0, [2, 6]), (1, [4]),
                                                                (2, [0, 3])]
    empty = LoRABatch.build(torch.tensor([-1, -1]))
    assert empty.groups == [] and empty.token_indices.numel() == 0


def test_each_token_gets_its_slots_delta():
    token_slots = [2, -1, 0, 2, 1, -1, 0]
    x, y0, a, b, batch, offsets = random_case(0, 3, 4, 16, [8, 4, 4], token_slots)
    got = lora_expand(y0.clone(), lora_shrink(x, a, batch), b, batch, offsets)
    for t, slot in enumerate(token_slots):
        want = y0[t].clone()
        if slot >= 0:
            for s in range(len(offsets) - 1):
                lo, hi = offsets[s], offsets[s + 1]
                want[lo:hi] += b[slot, lo:hi] @ (a[slot, s] @ x[t])
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


def cpu_ops():
    from runtime.platforms.cpu import kernels, ops
    from runtime.platforms.cpu.platform import CpuPlatform
    failed = kernels.load(CpuPlatform().info.model_name)
    if failed:
        pytest.skip(f"the CPU kernels did not build: {failed}")
    return ops


TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
MIXES = {"mixed": [2, -1, 0, 2, 1, -1, 0] * 3, "one slot": [1] * 21, "none": [-1] * 5,
         "decode batch": [s % 5 - 1 for s in range(64)],
         "prefill": [s // 100 - 1 for s in range(500)]}  # big enough for several threads


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("rank, d_in, sizes", [(8, 576, [576, 192, 192]),
                                               (16, 1536, [576]), (4, 64, [128, 128])])
def test_cpu_kernels_match_the_torch_reference(dtype, mix, rank, d_in, sizes):
    ops = cpu_ops()
    x, y0, a, b, batch, offsets = random_case(2, 4, rank, d_in, sizes, MIXES[mix], dtype)
    want_buf = lora_shrink(x, a, batch)
    buf = ops.lora_shrink(x, a, batch)
    assert buf.dtype == torch.float32
    torch.testing.assert_close(buf, want_buf, rtol=1e-4, atol=1e-3)
    want = lora_expand(y0.clone(), want_buf, b, batch, offsets)
    got = ops.lora_expand(y0.clone(), want_buf, b, batch, offsets)
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * 10)
    base = torch.tensor(MIXES[mix]) < 0
    assert torch.equal(got[base], y0[base])  # tokens without an adapter are untouched


def test_cpu_kernels_fall_back_on_shapes_they_do_not_take():
    ops = cpu_ops()
    x, y0, a, b, batch, offsets = random_case(3, 2, 4, 24, [20, 12], [0, 1, -1, 1])
    buf = ops.lora_shrink(x, a, batch)
    torch.testing.assert_close(buf, lora_shrink(x, a, batch))
    torch.testing.assert_close(ops.lora_expand(y0.clone(), buf, b, batch, offsets),
                               lora_expand(y0.clone(), buf, b, batch, offsets))


def test_triton_kernels_match_the_torch_reference():
    """Under TRITON_INTERPRET=1 on the CPU (tests/conftest.py sets it without a GPU)."""
    from runtime.platforms.cuda import lora_triton
    x, y0, a, b, batch, offsets = random_case(1, 2, 8, 48, [32, 16, 16], [1, -1, 0, 1, 1, -1])
    buf = lora_triton.lora_shrink(x, a, batch)
    torch.testing.assert_close(buf, lora_shrink(x, a, batch), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lora_triton.lora_expand(y0.clone(), buf, b, batch, offsets),
                               lora_expand(y0.clone(), buf, b, batch, offsets),
                               rtol=1e-4, atol=1e-4)


def test_triton_expand_copies_a_layers_offsets_to_the_device_once(monkeypatch):
    from runtime.platforms.cuda import lora_triton
    x, y0, a, b, batch, offsets = random_case(2, 2, 8, 48, [32, 16, 16], [1, -1, 0, 1])
    lora_triton.device_offsets.cache_clear()
    copies = []
    real = torch.tensor
    monkeypatch.setattr(lora_triton.torch, "tensor",
                        lambda *args, **kw: copies.append(args) or real(*args, **kw))
    buf = lora_triton.lora_shrink(x, a, batch)
    for _ in range(3):  # three steps of one layer
        got = lora_triton.lora_expand(y0.clone(), buf, b, batch, offsets)
    torch.testing.assert_close(got, lora_expand(y0.clone(), buf, b, batch, offsets),
                               rtol=1e-4, atol=1e-4)
    assert copies == [(tuple(offsets),)]
