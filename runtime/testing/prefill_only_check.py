"""A backend's prefill-only mode (pooling models) checked against plain attention: whole requests
of mixed lengths, each attending over its own tokens (both ways for encoders, `causal=False`),
with no KV cache at all. The reference is float32 `scaled_dot_product_attention` on the CPU from
the same rounded inputs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention_backends.base import prefill_only_metadata
LENS, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, SCALE = [5, 1, 17, 40], 8, 2, 64, 0.37
# atol = rtol per compute dtype
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def check_prefill_only(backend: type, dtype: torch.dtype, device: str | torch.device,
                       causal: bool, label: str = "") -> None:
    """Raise AssertionError, naming the request and the difference, when `backend`'s
    prefill-only step differs from plain attention beyond the dtype's tolerance."""
    gen = torch.Generator().manual_seed(0)
    t = sum(LENS)
    q, k, v = (torch.randn(t, heads, HEAD_SIZE, generator=gen).to(dtype)
               for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    impl = backend(NUM_HEADS, HEAD_SIZE, SCALE, NUM_KV_HEADS)
    out = impl.forward(q.to(device), k.to(device), v.to(device),
                       torch.empty(0, dtype=dtype, device=device),
                       prefill_only_metadata(LENS, causal, device)).float().cpu()
    group = NUM_HEADS // NUM_KV_HEADS
    tol = TOLERANCE.get(dtype, 3e-2)
    lo = 0
    for i, n in enumerate(LENS):
        rows = slice(lo, lo + n)
        ref = F.scaled_dot_product_attention(
            q[rows].float().transpose(0, 1),
            k[rows].float().transpose(0, 1).repeat_interleave(group, 0),
            v[rows].float().transpose(0, 1).repeat_interleave(group, 0),
            is_causal=causal, scale=SCALE).transpose(0, 1)
        worst = (out[rows] - ref).abs().max().item()
        if not torch.allclose(out[rows], ref, atol=tol, rtol=tol):
            raise AssertionError(
                f"attention backend {label or backend.name}: prefill-only step "
                f"({'causal' if causal else 'bidirectional'}, "
                f"{str(dtype).removeprefix('torch.')}) differs from plain attention in request "
                f"{i} of {n} tokens by up to {worst:.3g} (tolerance {tol})")
        lo += n
