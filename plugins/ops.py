"""The named layer ops of the custom-op contract (`runtime_custom_op`), in portable torch.

These are the reference every replacement must match, what the engine runs when no plugin
replaces an op, and the fallback a replacement may call for shapes its kernel does not take.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, scale in the input dtype (as HF Llama does)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def compose_add_rms_norm(norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
                         ) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """add_rms_norm built from an `rms_norm` op: (norm(x + residual), x + residual)."""
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + residual
        return norm(x, weight, eps), x
    return add_rms_norm


add_rms_norm = compose_add_rms_norm(rms_norm)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x holds [gate | up] on its last dimension; returns silu(gate) * up."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   group_size: int, norm_before_gate: bool) -> torch.Tensor:
    """The recurrent layers' gated RMSNorm over each `group_size` channels of x [T, D]:
    without `norm_before_gate`, weight * norm(x * silu(gate)) (transformers'
    `MambaRMSNormGated`); with it, weight * norm(x) * silu(gate) (the gated delta-nets'
    `RMSNormGated`). `weight` is [D], or [group_size] for every group alike. Arithmetic in
    float32; the norm is rounded to x's dtype before the weight product, as both round it, and
    the weight product before the gate."""
    t = x.size(0)
    h = x.float() if norm_before_gate else x.float() * F.silu(gate.float())
    h = h.view(t, -1, group_size)
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    h = weight.view(-1, group_size) * h
    if norm_before_gate:
        h = (h * F.silu(gate.float()).view(h.shape)).to(x.dtype)
    return h.view(t, -1)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotation of the first `cos_sin_cache.size(1)` dims of each head of `query`
    and `key` by `positions`, through the [max_position, rotary_dim] float32 cache of
    cos | sin. Returns new tensors of the inputs' shapes."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    rotary_dim = cos_sin_cache.size(1)
    return (_rotate(query, cos, sin, head_size, rotary_dim),
            _rotate(key, cos, sin, head_size, rotary_dim))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int,
            rotary_dim: int) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(shape[0], -1, head_size)
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)
    # Same operations, in the same dtype, as transformers' q * cos + rotate_half(q) * sin.
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rotary_dim < head_size:
        parts.append(x[..., rotary_dim:])
    return torch.cat(parts, dim=-1).reshape(shape)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Mixture of experts with a gated-silu MLP per expert: hidden [T, H]; w13 [E, 2I, H]
    (gate | up rows), w2 [E, H, I]; token t goes to experts topk_ids[t] [k] weighted by
    topk_weights[t] [k]. Returns [T, H] = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)).
    An id of -1 is an expert this rank does not hold (expert parallel): it adds nothing.

    The (token, expert) pairs are grouped by expert with one sort, then each expert that has
    tokens runs one GEMM pair over its group; the weighted rows are summed back per token."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    counts = torch.bincount(flat_ids + 1, minlength=w13.size(0) + 1).tolist()
    order = flat_ids.argsort(stable=True)[counts[0]:]  # the -1 pairs sort first
    rows = hidden[order // top_k]
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts[1:]):
        if count:
            x = rows[start:start + count]
            out[start:start + count] = silu_and_mul(x @ w13[expert].t()) @ w2[expert].t()
            start += count
    weighted = out * topk_weights.flatten()[order].unsqueeze(1).to(out.dtype)
    return torch.zeros_like(hidden).index_add_(0, order // top_k, weighted)


# op name -> the op a composite is built from, when no plugin at least as early in the hook's
# call order supplies the composite itself
COMPOSITES = {"add_rms_norm": ("rms_norm", compose_add_rms_norm)}


def greedy_argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's first maximum (NaN above all) of x [rows, n], as
    `argmax(dim=-1)`, which on the CPU was 3.7x slower than `max` on one core (15 ms against
    4 ms for 64 x 49152 float32 logits)."""
    return x.max(dim=-1).indices
