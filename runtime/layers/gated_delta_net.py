"""The gated delta-net token mixer of Qwen3.5 and Qwen3-Next (linear attention): a short causal
convolution over the q, k, v projections, then the gated delta rule, whose [Hv, K, V] state per
sequence lives in the recurrent state cache beside the paged KV cache."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.forward_context import get_forward_context
from runtime.layers.build_context import BuildContext
from runtime.layers.linear import RowParallelLinear
from runtime.layers.recurrent_sharding import (ShardedColumnLinear, load_rows, shard_rows,
                                               sharded_param, split)
from runtime.layers.recurrent_state import StatefulLayer, conv_states_at
from runtime.plugins import recurrent_ops
from runtime.plugins.ops import gated_rms_norm


class DepthwiseConvWeight(nn.Module):
    """A depthwise conv1d's weight as the ops take it, [channels, width], loaded from the
    checkpoint's nn.Conv1d layout [channels, 1, width]; and its bias [channels] when it has
    one (else None). Under tensor parallel `rows` are the checkpoint's channels this rank
    holds (see `recurrent_sharding`)."""

    def __init__(self, channels: int, width: int, dtype: torch.dtype, bias: bool = False,
                 rows: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, width, dtype=dtype),
                                   requires_grad=False)
        load_rows(self.weight, rows)
        self.bias = (nn.Parameter(torch.zeros(channels, dtype=dtype), requires_grad=False)
                     if bias else None)
        if bias:
            load_rows(self.bias, rows)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head, then times silu(gate), as transformers' `RMSNormGated`: the
    `gated_rms_norm` op over [T, heads, head size], one weight for every head."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype,
                 op: Callable[..., torch.Tensor] | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.op = op or gated_rms_norm

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        t, size = x.size(0), self.weight.numel()
        return self.op(x.reshape(t, -1), gate.reshape(t, -1), self.weight, self.eps, size,
                       True).view(x.shape)


class GatedDeltaNet(StatefulLayer):
    """Checkpoint names as transformers' `Qwen3_5GatedDeltaNet`: `in_proj_qkv`, `in_proj_z`,
    `in_proj_b`, `in_proj_a` (fused here into `in_proj`), `conv1d`, `dt_bias`, `A_log`,
    `norm`, `out_proj`."""

    # checkpoint projection -> shard of the fused `in_proj`
    in_proj_shards = {"in_proj_qkv": 0, "in_proj_z": 1, "in_proj_b": 2, "in_proj_a": 3}

    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        tp = ctx.tp_size
        what = "gated delta-net"
        # whole key heads per rank, each with its consecutive value heads
        self.num_k_heads = split(config.linear_num_key_heads, tp, f"{what} key heads")
        self.num_v_heads = split(config.linear_num_value_heads, tp, f"{what} value heads")
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        key_dim = config.linear_num_key_heads * self.head_k_dim
        value_dim = config.linear_num_value_heads * self.head_v_dim
        self.key_dim, self.value_dim = key_dim // tp, value_dim // tp
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = config.linear_conv_kernel_dim
        self.dtype = ctx.dtype
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"gated delta-net activation {config.hidden_act!r}: only silu "
                             "is supported")
        qkv = [(key_dim, True), (key_dim, True), (value_dim, True)]
        num_v = config.linear_num_value_heads
        self.in_proj = ShardedColumnLinear(
            config.hidden_size, [qkv, [(value_dim, True)], [(num_v, True)], [(num_v, True)]],
            False, ctx, f"{prefix}.in_proj")
        self.conv1d = DepthwiseConvWeight(
            self.conv_dim, self.conv_width, ctx.dtype,
            rows=shard_rows(qkv, ctx.tp_rank, tp, what) if tp > 1 else None)
        self.dt_bias = sharded_param(num_v, 1.0, ctx)
        self.A_log = sharded_param(num_v, 0.0, ctx)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, ctx.dtype,
                                 ctx.custom_op("gated_rms_norm"))
        self.out_proj = RowParallelLinear(value_dim, config.hidden_size, False, ctx,
                                          f"{prefix}.out_proj")
        self.conv_op = ctx.custom_op("causal_conv1d") or recurrent_ops.causal_conv1d
        self.conv_update_op = (ctx.custom_op("causal_conv1d_update")
                               or recurrent_ops.causal_conv1d_update)
        self.chunk_op = (ctx.custom_op("chunk_gated_delta_rule")
                         or recurrent_ops.chunk_gated_delta_rule)
        self.recurrent_op = (ctx.custom_op("fused_recurrent_gated_delta_rule")
                             or recurrent_ops.fused_recurrent_gated_delta_rule)

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The conv state in the model dtype and the delta-rule state in float32, as
        transformers keeps them."""
        return [((self.conv_dim, self.conv_width - 1), self.dtype),
                ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        md = get_forward_context()
        t = hidden.size(0)
        qkv, z, b, a = self.in_proj(hidden).split(
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], -1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        conv_state, ssm_state = self.states
        nd = md.num_decode_tokens  # decodes first, one token each
        slots = md.state_indices
        out = torch.empty(t, self.num_v_heads, self.head_v_dim, dtype=hidden.dtype,
                          device=hidden.device)
        if nd:
            x = self.conv_update_op(qkv[:nd], conv_state, self.conv1d.weight, None, "silu",
                                    slots[:nd])
            q, k, v = self._heads(x)
            out[:nd] = self.recurrent_op(q, k, v, g[:nd], beta[:nd], ssm_state, slots[:nd],
                                         use_qk_l2norm=True)
            self.checkpoint_decodes(md)
        if nd < t:
            rows, has = slots[nd:], md.has_initial_state[nd:]
            starts = md.query_start_loc[nd:] - nd
            at, entries = self.prefill_checkpoints(md)
            initial = conv_state[rows]
            x, conv_final = self.conv_op(qkv[nd:], self.conv1d.weight, None, starts, initial,
                                         has, "silu")
            conv_state[rows] = conv_final
            q, k, v = self._heads(x)
            kept = self.checkpoint_states(at)
            out[nd:], ssm_final = self.chunk_op(q, k, v, g[nd:], beta[nd:], starts,
                                                ssm_state[rows], has, use_qk_l2norm=True,
                                                checkpoint_rows=at, checkpoint_states=kept)
            ssm_state[rows] = ssm_final
            if at is not None:
                self.store(0, entries, conv_states_at(qkv[nd:], initial, has, starts, at))
                self.store(1, entries, kept)
        out = self.norm(out, z.view(t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.view(t, self.value_dim))

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], -1)
        t = x.size(0)
        return (q.view(t, self.num_k_heads, self.head_k_dim),
                k.view(t, self.num_k_heads, self.head_k_dim),
                v.view(t, self.num_v_heads, self.head_v_dim))
