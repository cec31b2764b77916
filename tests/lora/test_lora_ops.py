"""lora_shrink / lora_expand: tokens of different slots (and none) in one call give each token
its own adapter's x @ A.T @ B.T, slice by slice."""
from __future__ import annotations

import torch

from runtime.plugins.lora_ops import LoRABatch, lora_expand, lora_shrink


def random_case(seed: int, num_slots: int, rank: int, d_in: int, sizes: list[int],
                token_slots: list[int]):
    """(x, y, a, b, batch, offsets) for a layer of `sizes` output slices."""
    torch.manual_seed(seed)
    slots = torch.tensor(token_slots)
    batch = LoRABatch(slots, [(s, (slots == s).nonzero().squeeze(1))
                              for s in sorted(set(token_slots) - {-1})])
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return (torch.randn(len(token_slots), d_in), torch.randn(len(token_slots), sum(sizes)),
            torch.randn(num_slots, len(sizes), rank, d_in),
            torch.randn(num_slots, sum(sizes), rank), batch, offsets)


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


def test_triton_kernels_match_the_torch_reference():
    """Under TRITON_INTERPRET=1 on the CPU (tests/conftest.py sets it without a GPU)."""
    from runtime.platforms.cuda import lora_triton
    x, y0, a, b, batch, offsets = random_case(1, 2, 8, 48, [32, 16, 16], [1, -1, 0, 1, 1, -1])
    buf = lora_triton.lora_shrink(x, a, batch)
    torch.testing.assert_close(buf, lora_shrink(x, a, batch), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lora_triton.lora_expand(y0.clone(), buf, b, batch, offsets),
                               lora_expand(y0.clone(), buf, b, batch, offsets),
                               rtol=1e-4, atol=1e-4)
