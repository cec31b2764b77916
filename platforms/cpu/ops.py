"""The CPU platform's custom ops: the fused layer ops of `csrc/layer_ops.cpp` and
`csrc/encoder_ops.cpp`, with the portable
ones as fallback for shapes the kernels do not take (a last dimension that is not a multiple of
16 or a rotary dimension not a multiple of 32, strided views such as Qwen3's per-head q/k norms),
and the dense `linear` kernel (per weight shape and row count the fastest of torch's product,
oneDNN's and `csrc/dense.cpp`'s over pre-packed weights)."""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F

from runtime.platforms.cpu.linear_choice import (PRODUCTS, ProductChoice, candidates, prepare,
                                                  timed_products)
from runtime.plugins import kda_ops as portable_kda
from runtime.plugins import lora_ops as portable_lora
from runtime.plugins import recurrent_ops as portable_recurrent
from runtime.plugins.lora_ops import LoRABatch
from runtime.plugins.ops import add_rms_norm as portable_add_rms_norm
from runtime.plugins.ops import gated_rms_norm as portable_gated_rms_norm
from runtime.plugins.ops import greedy_argmax as portable_greedy_argmax
from runtime.plugins.ops import rms_norm as portable_rms_norm
from runtime.plugins.ops import rotary_embedding as portable_rotary_embedding
from runtime.plugins.ops import silu_and_mul as portable_silu_and_mul


def _fits(x: torch.Tensor, multiple: int) -> bool:
    return x.is_contiguous() and x.size(-1) % multiple == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _fits(x, 16):
        return portable_rms_norm(x, weight, eps)
    return torch.ops.runtime_cpu.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not (_fits(x, 16) and residual.is_contiguous()):
        return portable_add_rms_norm(x, residual, weight, eps)
    return torch.ops.runtime_cpu.add_rms_norm(x, residual, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   group_size: int, norm_before_gate: bool) -> torch.Tensor:
    """One pass per row where the portable op takes eight to eleven torch ops, each over a
    float32 copy of the rows."""
    if (x.dim() != 2 or gate.shape != x.shape or x.stride(-1) != 1 or gate.stride(-1) != 1
            or group_size % 16 or x.size(-1) % group_size or gate.dtype != x.dtype
            or weight.dtype != x.dtype):
        return portable_gated_rms_norm(x, gate, weight, eps, group_size, norm_before_gate)
    return torch.ops.runtime_cpu.gated_rms_norm(x, gate, weight, eps, group_size,
                                                norm_before_gate)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not _fits(x, 32):
        return portable_silu_and_mul(x)
    return torch.ops.runtime_cpu.silu_and_mul(x)


def greedy_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch's `max(dim=-1)` ran 2.8 ms on 64 x 49152 float32 logits on two threads of an
    AVX-512 EPYC (1.8 ms on one); the kernel reads them once at memory speed, in float32,
    bfloat16 or float16."""
    if (x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or x.stride(-1) != 1 or x.size(-1) == 0):
        return portable_greedy_argmax(x)
    return torch.ops.runtime_cpu.greedy_argmax(x)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on `query` and `key` [T, heads * head_size] (rows may be strided, as the
    slices of a fused qkv output are); returns them."""
    if (cos_sin_cache.size(1) % 32 or query.dim() != 2 or key.dim() != 2
            or query.stride(1) != 1 or key.stride(1) != 1):
        return portable_rotary_embedding(positions, query, key, cos_sin_cache, head_size)
    torch.ops.runtime_cpu.rotary_embedding(positions, query, key, cos_sin_cache, head_size)
    return query, key


def gelu(x: torch.Tensor) -> torch.Tensor:
    """erf GELU (BERT's "gelu")."""
    if not _fits(x, 16):
        return F.gelu(x)
    return torch.ops.runtime_cpu.gelu(x)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float) -> torch.Tensor:
    """layer_norm(x + residual): BERT's output blocks."""
    if not (_fits(x, 16) and residual.is_contiguous() and residual.dtype == x.dtype
            and weight.dtype == x.dtype):
        return F.layer_norm(x + residual, weight.shape, weight, bias, eps)
    return torch.ops.runtime_cpu.add_layer_norm(x, residual, weight, bias, eps)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    if not (x.stride(-1) == 1 and x.size(-1) % 16 == 0 and a.is_contiguous()
            and a.dtype == x.dtype):
        return portable_lora.lora_shrink(x, a, batch)
    return torch.ops.runtime_cpu.lora_shrink(x, a, batch.token_indices, batch.seg_starts,
                                             batch.seg_slots)


def lora_expand(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
                offsets: list[int]) -> torch.Tensor:
    """The kernel reads b with contiguous columns (stored [slots, rank, out], as the LoRA
    layers hold it) and slices whose offsets are multiples of 16."""
    if not (y.stride(-1) == 1 and b.stride(1) == 1 and b.dtype == y.dtype
            and all(o % 16 == 0 for o in offsets)):
        return portable_lora.lora_expand(y, buf, b, batch, offsets)
    return torch.ops.runtime_cpu.lora_expand(y, buf.float().contiguous(), b, batch.token_indices,
                                             batch.seg_starts, batch.seg_slots, offsets)


def _rows(state_indices: torch.Tensor | None, seqs: int) -> torch.Tensor:
    if state_indices is None:
        return torch.arange(seqs)
    return state_indices.long().contiguous()


def _prefill_states(initial_state: torch.Tensor | None, has_initial_state: torch.Tensor | None,
                    shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """A fresh state buffer (a copy: the caller's states stay as they were) the kernel runs on
    in place, and which rows start from it."""
    if initial_state is None:
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape[0], dtype=torch.bool)
    has = (has_initial_state.bool().contiguous() if has_initial_state is not None
           else torch.ones(shape[0], dtype=torch.bool))
    return initial_state.to(dtype, memory_format=torch.contiguous_format, copy=True), has


def _start_states(initial_state: torch.Tensor | None, has_initial_state: torch.Tensor | None,
                  shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 buffer a recurrence kernel runs on in place: a copy of the initial states,
    zero for the rows that start fresh."""
    state, has = _prefill_states(initial_state, has_initial_state, shape, torch.float32)
    state[~has] = 0
    return state


def _final_states(state: torch.Tensor, initial_state: torch.Tensor | None) -> torch.Tensor:
    """The kernel's final states in the initial states' dtype (float32 without them)."""
    return state.to(initial_state.dtype if initial_state is not None else torch.float32)


def _conv_params(weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The conv weight and bias as the kernel takes them: contiguous float32."""
    return weight.float().contiguous(), None if bias is None else bias.float().contiguous()


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  query_start_loc: torch.Tensor, initial_state: torch.Tensor | None = None,
                  has_initial_state: torch.Tensor | None = None, activation: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    if activation not in (None, "silu", "swish") or x.size(-1) % 16 or weight.size(1) > 8:
        return portable_recurrent.causal_conv1d(x, weight, bias, query_start_loc, initial_state,
                                                has_initial_state, activation)
    seqs = query_start_loc.numel() - 1
    dtype = initial_state.dtype if initial_state is not None else torch.float32
    state, has = _prefill_states(initial_state, has_initial_state,
                                 (seqs, x.size(1), weight.size(1) - 1),
                                 dtype if dtype in (torch.float32, x.dtype) else torch.float32)
    out = torch.ops.runtime_cpu.causal_conv1d(
        x.contiguous(), *_conv_params(weight, bias), query_start_loc.long().contiguous(), state,
        torch.arange(seqs), has, activation is not None)
    return out, state.to(dtype)


def causal_conv1d_update(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, activation: str | None = None,
                         state_indices: torch.Tensor | None = None) -> torch.Tensor:
    if (activation not in (None, "silu", "swish") or x.size(-1) % 16 or weight.size(1) > 8
            or not state.is_contiguous() or state.dtype not in (torch.float32, x.dtype)):
        return portable_recurrent.causal_conv1d_update(x, state, weight, bias, activation,
                                                       state_indices)
    seqs = x.size(0)
    return torch.ops.runtime_cpu.causal_conv1d(
        x.contiguous(), *_conv_params(weight, bias), torch.arange(seqs + 1), state,
        _rows(state_indices, seqs), torch.ones(seqs, dtype=torch.bool), activation is not None)


def _gdn_fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    return v.size(-1) % 16 == 0 and v.size(-2) % q.size(-2) == 0


def _gdn_scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else q.size(-1) ** -0.5


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, query_start_loc: torch.Tensor,
                           initial_state: torch.Tensor | None = None,
                           has_initial_state: torch.Tensor | None = None,
                           use_qk_l2norm: bool = False, scale: float | None = None,
                           chunk_size: int = 64, checkpoint_rows: torch.Tensor | None = None,
                           checkpoint_states: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel runs the recurrence token by token (each work item's block of the state stays
    in L1): the same contract, and the same result to float32 rounding."""
    if not _gdn_fits(q, v):
        return portable_recurrent.chunk_gated_delta_rule(
            q, k, v, g, beta, query_start_loc, initial_state, has_initial_state, use_qk_l2norm,
            scale, chunk_size, checkpoint_rows, checkpoint_states)
    seqs = query_start_loc.numel() - 1
    state = _start_states(initial_state, has_initial_state,
                          (seqs, v.size(1), k.size(-1), v.size(-1)))
    out = torch.ops.runtime_cpu.gated_delta_rule(
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
        beta.float().contiguous(), query_start_loc.long().contiguous(), state,
        torch.arange(seqs), use_qk_l2norm, _gdn_scale(q, scale),
        None if checkpoint_rows is None else checkpoint_rows.long().contiguous(),
        checkpoint_states)
    return out, _final_states(state, initial_state)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                                     state_indices: torch.Tensor | None = None,
                                     use_qk_l2norm: bool = False,
                                     scale: float | None = None) -> torch.Tensor:
    if not (_gdn_fits(q, v) and state.dtype == torch.float32 and state.is_contiguous()):
        return portable_recurrent.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, state, state_indices, use_qk_l2norm, scale)
    seqs = v.size(0)
    return torch.ops.runtime_cpu.gated_delta_rule(
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
        beta.float().contiguous(), torch.arange(seqs + 1), state,
        _rows(state_indices, seqs), use_qk_l2norm, _gdn_scale(q, scale))


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, query_start_loc: torch.Tensor,
              initial_state: torch.Tensor | None = None,
              has_initial_state: torch.Tensor | None = None,
              checkpoint_rows: torch.Tensor | None = None,
              checkpoint_states: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule's kernel with a decay per key channel."""
    if not _gdn_fits(q, v):
        return portable_kda.chunk_kda(q, k, v, g, beta, query_start_loc, initial_state,
                                      has_initial_state, checkpoint_rows, checkpoint_states)
    seqs = query_start_loc.numel() - 1
    state = _start_states(initial_state, has_initial_state,
                          (seqs, v.size(1), k.size(-1), v.size(-1)))
    out = torch.ops.runtime_cpu.kimi_delta_rule(
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().exp().contiguous(),
        beta.float().contiguous(), query_start_loc.long().contiguous(), state,
        torch.arange(seqs), True, q.size(-1) ** -0.5,
        None if checkpoint_rows is None else checkpoint_rows.long().contiguous(),
        checkpoint_states)
    return out, _final_states(state, initial_state)


def fused_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor,
                        state_indices: torch.Tensor | None = None) -> torch.Tensor:
    if not (_gdn_fits(q, v) and state.dtype == torch.float32 and state.is_contiguous()):
        return portable_kda.fused_recurrent_kda(q, k, v, g, beta, state, state_indices)
    seqs = v.size(0)
    return torch.ops.runtime_cpu.kimi_delta_rule(
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().exp().contiguous(),
        beta.float().contiguous(), torch.arange(seqs + 1), state, _rows(state_indices, seqs),
        True, q.size(-1) ** -0.5)


def _mamba2_fits(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> bool:
    return B.size(-1) % 16 == 0 and B.dtype == x.dtype and C.dtype == x.dtype


def _mamba2_params(A: torch.Tensor, D: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    return A.float().contiguous(), None if D is None else D.float().contiguous()


def mamba2_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                      dt_softplus: bool, query_start_loc: torch.Tensor,
                      initial_state: torch.Tensor | None = None,
                      has_initial_state: torch.Tensor | None = None, chunk_size: int = 256,
                      dt_limit: tuple[float, float] = (0.0, float("inf")),
                      checkpoint_rows: torch.Tensor | None = None,
                      checkpoint_states: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel runs the recurrence token by token (a tile of a head's state rows in
    registers through 16 tokens at a time), which on a CPU beat the chunked quadratic form;
    `chunk_size` is only a hint here and goes unused. The same contract, the same result to
    float32 rounding."""
    if not _mamba2_fits(x, B, C):
        return portable_recurrent.mamba2_chunk_scan(
            x, dt, A, B, C, D, dt_bias, dt_softplus, query_start_loc, initial_state,
            has_initial_state, chunk_size, dt_limit, checkpoint_rows, checkpoint_states)
    seqs = query_start_loc.numel() - 1
    state = _start_states(initial_state, has_initial_state, (seqs, *x.shape[1:], B.size(-1)))
    dt = portable_recurrent.mamba2_dt(dt, dt_bias, dt_softplus, dt_limit)
    A, D = _mamba2_params(A, D)
    y = torch.ops.runtime_cpu.mamba2_scan(
        x.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous(), D,
        query_start_loc.long().contiguous(), state, torch.arange(seqs),
        None if checkpoint_rows is None else checkpoint_rows.long().contiguous(),
        checkpoint_states)
    return y, _final_states(state, initial_state)


def mamba2_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                        A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                        dt_softplus: bool, state_indices: torch.Tensor | None = None,
                        dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    if not (state.dtype == torch.float32 and state.is_contiguous() and _mamba2_fits(x, B, C)):
        return portable_recurrent.mamba2_state_update(state, x, dt, A, B, C, D, dt_bias,
                                                      dt_softplus, state_indices, dt_limit)
    dt = portable_recurrent.mamba2_dt(dt, dt_bias, dt_softplus, dt_limit)
    seqs = x.size(0)
    A, D = _mamba2_params(A, D)
    return torch.ops.runtime_cpu.mamba2_scan(
        x.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous(), D,
        torch.arange(seqs + 1), state, _rows(state_indices, seqs))


def _scan_fits(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> bool:
    return A.size(-1) % 16 == 0 and B.dtype == x.dtype and C.dtype == x.dtype


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                   dt_bias: torch.Tensor | None, dt_softplus: bool,
                   query_start_loc: torch.Tensor, initial_state: torch.Tensor | None = None,
                   has_initial_state: torch.Tensor | None = None,
                   checkpoint_rows: torch.Tensor | None = None,
                   checkpoint_states: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    if not _scan_fits(x, A, B, C):
        return portable_recurrent.selective_scan(
            x, dt, A, B, C, D, z, dt_bias, dt_softplus, query_start_loc, initial_state,
            has_initial_state, checkpoint_rows, checkpoint_states)
    seqs = query_start_loc.numel() - 1
    state = _start_states(initial_state, has_initial_state, (seqs, *A.shape))
    y = torch.ops.runtime_cpu.selective_scan(
        x.contiguous(), portable_recurrent.mamba_dt(dt, dt_bias, dt_softplus).contiguous(),
        A.float().contiguous(), B.contiguous(), C.contiguous(),
        query_start_loc.long().contiguous(), state, torch.arange(seqs),
        None if checkpoint_rows is None else checkpoint_rows.long().contiguous(),
        checkpoint_states)
    final = _final_states(state, initial_state)
    return portable_recurrent.mamba_out(y, x, D, z), final


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                           A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           D: torch.Tensor | None, z: torch.Tensor | None,
                           dt_bias: torch.Tensor | None, dt_softplus: bool,
                           state_indices: torch.Tensor | None = None) -> torch.Tensor:
    if not (_scan_fits(x, A, B, C) and state.dtype == torch.float32 and state.is_contiguous()):
        return portable_recurrent.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias,
                                                         dt_softplus, state_indices)
    seqs = x.size(0)
    y = torch.ops.runtime_cpu.selective_scan(
        x.contiguous(), portable_recurrent.mamba_dt(dt, dt_bias, dt_softplus).contiguous(),
        A.float().contiguous(), B.contiguous(), C.contiguous(), torch.arange(seqs + 1), state,
        _rows(state_indices, seqs))
    return portable_recurrent.mamba_out(y, x, D, z)


# In bf16 (fp16) torch's own product is oneDNN already, re-ordering the weight every call; the
# packed copy saves that at every row count and thread count. Measured on a 2-core AVX512-BF16
# EPYC, SmolLM2-135M's shapes: 1 thread, rows 1-256 gain 1.1-2.4x, 512-2048 rows 1.0-1.1x.
LINEAR_ENV = "RUNTIME_CPU_LINEAR"  # one of PRODUCTS for every layer and row count, untimed


def dense_products(weight: torch.Tensor) -> ProductChoice:
    """The product `weight`'s layer runs at each row count on this host: the one
    `RUNTIME_CPU_LINEAR` names; else, for float32 and (where `dense` takes it) bfloat16, the
    one measured on this host for its shape (`linear_choice.py`) at the thread count set before
    the model loads; else bf16/fp16 packed for oneDNN where the ISA computes that dtype."""
    allowed = candidates(weight.dtype)
    forced = os.environ.get(LINEAR_ENV)
    if forced:
        if forced not in allowed:
            raise ValueError(f"{LINEAR_ENV}={forced!r}: {str(weight.dtype)[6:]} layers on this "
                             f"host run {', '.join(allowed)} (of {', '.join(PRODUCTS)})")
        return ProductChoice.everywhere(forced)
    out_features, in_features = weight.shape
    if weight.dtype == torch.float32:
        return timed_products(torch.get_num_threads(), weight.dtype, in_features, out_features,
                              allowed)
    # bf16 `dense` reads K in pairs; torch's bf16 product is slower than the packed ones
    if weight.dtype == torch.bfloat16 and "dense" in allowed and in_features % 2 == 0:
        return timed_products(torch.get_num_threads(), weight.dtype, in_features, out_features,
                              tuple(name for name in allowed if name != "torch"))
    return ProductChoice.everywhere("onednn" if "onednn" in allowed else "torch")


def linear(weight: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """A dense layer's kernel: at each row count the product `dense_products` gives, with the
    packed copies those need made now (each costs the weight's size again in memory); torch's
    product for inputs that are not contiguous and 2-D."""
    choice = dense_products(weight)
    kernels = {name: prepare(name, weight) for name in choice.products() - {"torch"}}
    if not kernels:
        return lambda x, bias: F.linear(x, weight, bias)

    def apply(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel = kernels.get(choice.product(x.size(0))) if x.dim() == 2 else None
        if kernel is None or not x.is_contiguous():
            return F.linear(x, weight, bias)
        return kernel(x, bias)
    return apply


# The ops that need the built kernels (`linear` runs without them, on torch's and oneDNN's
# products).
OPS = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "silu_and_mul": silu_and_mul,
       "gated_rms_norm": gated_rms_norm,
       "rotary_embedding": rotary_embedding, "lora_shrink": lora_shrink, "lora_expand": lora_expand,
       "gelu": gelu, "add_layer_norm": add_layer_norm, "causal_conv1d": causal_conv1d,
       "causal_conv1d_update": causal_conv1d_update,
       "chunk_gated_delta_rule": chunk_gated_delta_rule,
       "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
       "chunk_kda": chunk_kda, "fused_recurrent_kda": fused_recurrent_kda,
       "mamba2_chunk_scan": mamba2_chunk_scan, "mamba2_state_update": mamba2_state_update,
       "selective_scan": selective_scan,
       "selective_state_update": selective_state_update, "greedy_argmax": greedy_argmax}
