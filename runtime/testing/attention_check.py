"""An attention backend checked against the portable torch backend, with a report of the mismatch.

The batch mixes decodes and prefill chunks over a paged cache whose blocks are out of order, with
more query heads than KV heads (a wrong grouped-query mapping shows), and runs in two steps: step
1 prefills each request's earlier context, writing it through the backend; step 2 runs the new
tokens, which read that context back from the cache (a backend that never writes the cache
shows here). The reference runs in float32 on the CPU from the very same (rounded) inputs, with
the same softmax scale, sliding window and logit soft-cap.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.testing.paged_batch import run_two_steps

# decodes first, then prefill chunks with and without earlier context
QUERY_LENS, SEQ_LENS = [1, 1, 1, 7, 20], [9, 40, 17, 7, 45]
BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 16, 8, 2, 64
# atol = rtol per compute dtype: float32 is exact but for the order of accumulation; the
# half-precision ones round every score, probability and output
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
STEPS = ("step 1 (prefill of the context, writing the KV cache)",
         "step 2 (decodes and prefill chunks reading the KV cache of step 1)")


@dataclass(frozen=True)
class AttentionCase:
    """The layer settings a check runs with (None: the backend's default)."""

    scale: float | None = None
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    def describe(self, dtype: torch.dtype) -> str:
        scale = HEAD_SIZE ** -0.5 if self.scale is None else self.scale
        return (f"{str(dtype).removeprefix('torch.')}, scale {scale:.4g}, sliding_window "
                f"{self.sliding_window}, logits_soft_cap {self.logits_soft_cap}, {NUM_HEADS} "
                f"query heads over {NUM_KV_HEADS} KV heads")


# what the conformance suite checks, each for every dtype the platform declares: never the
# default scale head_size ** -0.5, so a hard-coded one shows
CASES = {"scale": AttentionCase(scale=0.37),
         "sliding-window": AttentionCase(scale=0.2, sliding_window=12),
         "soft-cap": AttentionCase(scale=0.37, logits_soft_cap=1.5)}


def check_attention(backend: type, dtype: torch.dtype, device: str | torch.device,
                    case: AttentionCase = AttentionCase(), label: str = "") -> None:
    """Raise AssertionError, saying where and by how much, when `backend` differs from the
    portable reference beyond the dtype's tolerance."""
    shape = (QUERY_LENS, SEQ_LENS, BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE)
    settings = dict(sliding_window=case.sliding_window, scale=case.scale,
                    logits_soft_cap=case.logits_soft_cap)
    got = run_two_steps(backend, *shape, dtype, device, **settings)
    want = run_two_steps(TorchPagedAttention, *shape, torch.float32, "cpu", input_dtype=dtype,
                         **settings)
    tol = TOLERANCE.get(dtype, 3e-2)
    for step, g, w, layout in zip(STEPS, got, want, step_layouts()):
        problem = mismatch(g, w, tol, layout)
        if problem:
            raise AssertionError(f"attention backend {label or backend.name} differs from the "
                                 f"portable reference in {step}, {case.describe(dtype)}:\n"
                                 f"  {problem}")


def step_layouts() -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(request, first position, tokens) in the order each step of `run_two_steps` lays its
    tokens out."""
    context = sorted(((i, 0, s - q) for i, (q, s) in enumerate(zip(QUERY_LENS, SEQ_LENS))
                      if s > q), key=lambda r: r[2] > 1)
    return context, [(i, s - q, q) for i, (q, s) in enumerate(zip(QUERY_LENS, SEQ_LENS))]


def mismatch(got: torch.Tensor, want: torch.Tensor, tol: float,
             layout: list[tuple[int, int, int]]) -> str | None:
    """None when every value is within atol = rtol = `tol`, else where it is worst and how many
    are off. `got` and `want` are [tokens, heads, head_size]; `layout` says whose tokens they
    are (`step_layouts`)."""
    if got.shape != want.shape:
        return f"output shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    bad = ~torch.isclose(got, want, atol=tol, rtol=tol)
    if not bad.any():
        return None
    error = (got - want).abs().nan_to_num(float("inf"))
    token, rest = divmod(int(error.argmax()), got.shape[1] * got.shape[2])
    head, dim = divmod(rest, got.shape[2])
    start = 0
    for request, first, count in layout:
        if token < start + count:
            break
        start += count
    return (f"{int(bad.sum())} of {bad.numel()} values outside atol = rtol = {tol:g}; the worst "
            f"at request {request} position {first + token - start}, head {head} (KV head "
            f"{head // (NUM_HEADS // NUM_KV_HEADS)}), dim {dim}: got "
            f"{got[token, head, dim].item():.6g}, want {want[token, head, dim].item():.6g}")
