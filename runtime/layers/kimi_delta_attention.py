"""Kimi delta attention (KDA), the linear-attention token mixer of Kimi Linear: q, k, v
projections through one short causal conv (silu), a forget gate per key channel, then the
KDA recurrence (`runtime.plugins.kda_ops`), whose [H, K, V] state per sequence lives in the
recurrent state cache; a per-head RMSNorm gated by sigmoid, the output projection.

Checkpoint names as the checkpoints' (transformers saves them so): `q_proj`, `k_proj`,
`v_proj`, `q_conv1d`, `k_conv1d`, `v_conv1d` (one conv here, `load_conv`), the forget gate's
`f_a_proj`, `f_b_proj`, `dt_bias`, `A_log`, `b_proj`, `g_a_proj`, `g_b_proj`, `o_norm`,
`o_proj`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.forward_context import get_forward_context
from runtime.layers.build_context import BuildContext
from runtime.layers.gated_delta_net import DepthwiseConvWeight
from runtime.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from runtime.layers.recurrent_sharding import sharded_param, split
from runtime.layers.recurrent_state import StatefulLayer, conv_states_at
from runtime.plugins import kda_ops, recurrent_ops


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm over each head in float32 (its weight too), then times sigmoid(gate)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = self.weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(StatefulLayer):
    """Under tensor parallel each rank holds consecutive heads (`recurrent_sharding`): their
    rows of q, k, v, `f_b_proj`, `dt_bias`, `A_log`, `b_proj`, `g_b_proj` and the conv; the
    low-rank inputs `f_a_proj` and `g_a_proj` whole; `o_proj` row-parallel."""

    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Kimi delta attention: activation {config.hidden_act!r} is not "
                             "supported (silu only)")
        hidden, total_heads = config.hidden_size, config.linear_num_heads
        self.heads = split(total_heads, ctx.tp_size, "Kimi delta attention heads")
        self.head_dim = config.linear_head_dim
        self.dim = self.heads * self.head_dim
        total_dim = total_heads * self.head_dim
        self.tp_rank = ctx.tp_rank
        self.conv_width, self.dtype = config.linear_conv_kernel_dim, ctx.dtype
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, ColumnParallelLinear(hidden, total_dim, False, ctx,
                                                     f"{prefix}.{name}"))
        self.conv1d = DepthwiseConvWeight(3 * self.dim, self.conv_width, ctx.dtype)
        # the forget gate: g = -exp(A_log[h]) softplus(f_b(f_a(x)) + dt_bias) per key channel
        self.f_a_proj = ReplicatedLinear(hidden, self.head_dim, False, ctx, f"{prefix}.f_a_proj")
        self.f_b_proj = ColumnParallelLinear(self.head_dim, total_dim, False, ctx,
                                             f"{prefix}.f_b_proj")
        # float32, as transformers keeps it
        self.dt_bias = sharded_param(total_dim, 0.0, ctx, dtype=torch.float32)
        self.A_log = sharded_param(total_heads, 0.0, ctx)
        self.b_proj = ColumnParallelLinear(hidden, total_heads, False, ctx, f"{prefix}.b_proj")
        self.g_a_proj = ReplicatedLinear(hidden, self.head_dim, False, ctx, f"{prefix}.g_a_proj")
        self.g_b_proj = ColumnParallelLinear(self.head_dim, total_dim, False, ctx,
                                             f"{prefix}.g_b_proj")
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(total_dim, hidden, False, ctx, f"{prefix}.o_proj")
        self.conv_op = ctx.custom_op("causal_conv1d") or recurrent_ops.causal_conv1d
        self.conv_update_op = (ctx.custom_op("causal_conv1d_update")
                               or recurrent_ops.causal_conv1d_update)
        self.chunk_op = ctx.custom_op("chunk_kda") or kda_ops.chunk_kda
        self.recurrent_op = ctx.custom_op("fused_recurrent_kda") or kda_ops.fused_recurrent_kda

    def load_conv(self, part: str, loaded: torch.Tensor) -> None:
        """This rank's channels of the checkpoint's conv of part "q", "k" or "v"
        ([dim, 1, width]) into its third of `conv1d`."""
        first = "qkv".index(part) * self.dim
        rows = loaded.reshape(-1, self.conv_width).narrow(0, self.tp_rank * self.dim, self.dim)
        self.conv1d.weight.data[first:first + self.dim].copy_(rows)

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias).view(
            -1, self.heads, self.head_dim)
        return -self.A_log.float().view(self.heads, 1).exp() * F.softplus(g)

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The conv state in the model dtype, the KDA state in float32."""
        return [((3 * self.dim, self.conv_width - 1), self.dtype),
                ((self.heads, self.head_dim, self.head_dim), torch.float32)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        md = get_forward_context()
        t = hidden.size(0)
        qkv = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], -1)
        g = self.forget_gate(hidden)
        beta = self.b_proj(hidden).float().sigmoid()
        conv_state, kda_state = self.states
        nd, slots = md.num_decode_tokens, md.state_indices  # decodes first, one token each
        out = torch.empty(t, self.heads, self.head_dim, dtype=hidden.dtype, device=hidden.device)
        if nd:
            x = self.conv_update_op(qkv[:nd], conv_state, self.conv1d.weight, None, "silu",
                                    slots[:nd])
            out[:nd] = self.recurrent_op(*self._heads(x), g[:nd], beta[:nd], kda_state,
                                         slots[:nd])
            self.checkpoint_decodes(md)
        if nd < t:
            rows, has = slots[nd:], md.has_initial_state[nd:]
            starts = md.query_start_loc[nd:] - nd
            at, entries = self.prefill_checkpoints(md)
            initial = conv_state[rows]
            x, conv_final = self.conv_op(qkv[nd:], self.conv1d.weight, None, starts, initial,
                                         has, "silu")
            conv_state[rows] = conv_final
            kept = self.checkpoint_states(at)
            out[nd:], final = self.chunk_op(*self._heads(x), g[nd:], beta[nd:], starts,
                                            kda_state[rows], has, checkpoint_rows=at,
                                            checkpoint_states=kept)
            kda_state[rows] = final
            if at is not None:
                self.store(0, entries, conv_states_at(qkv[nd:], initial, has, starts, at))
                self.store(1, entries, kept)
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(t, self.heads, self.head_dim)
        return self.o_proj(self.o_norm(out, gate).view(t, self.dim))

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(part.view(x.size(0), self.heads, self.head_dim)
                     for part in x.split(self.dim, -1))
