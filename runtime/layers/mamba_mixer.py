"""Mamba 1's mixer (selective state space) as transformers' `MambaMixer`: one input projection
into the SSM input and its gate; a causal conv over the input; `x_proj` into the step rank, B
and C, `dt_proj` back to one step size per channel; the selective scan, whose [d_inner, N]
state per sequence lives in the recurrent state cache; the output projection. Mamba and Jamba
share it (Jamba RMS-normalises dt, B and C before they are used)."""
from __future__ import annotations

import torch

from runtime.forward_context import get_forward_context
from runtime.layers.build_context import BuildContext
from runtime.layers.gated_delta_net import DepthwiseConvWeight
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from runtime.layers.recurrent_sharding import ShardedColumnLinear, shard_rows, sharded_param, split
from runtime.layers.recurrent_state import StatefulLayer, conv_states_at
from runtime.plugins import recurrent_ops


class MambaMixer(StatefulLayer):
    """Checkpoint names as transformers': `in_proj`, `conv1d`, `x_proj`, `dt_proj`, `A_log`
    [d_inner, N], `D`, `out_proj`, and with `bcdt_norm_eps` Jamba's `dt_layernorm`,
    `b_layernorm`, `c_layernorm`."""

    def __init__(self, ctx: BuildContext, prefix: str, *, hidden_size: int,
                 intermediate_size: int, state_size: int, conv_kernel: int, dt_rank: int,
                 use_conv_bias: bool, use_bias: bool, activation: str,
                 bcdt_norm_eps: float | None = None) -> None:
        super().__init__()
        if activation not in ("silu", "swish"):
            raise ValueError(f"Mamba: activation {activation!r} is not supported (silu only)")
        # Channels split over the ranks; x_proj all-reduces: dt, B and C are needed whole.
        tp = ctx.tp_size
        self.intermediate_size = split(intermediate_size, tp, "Mamba channels")
        self.state_size = state_size
        self.conv_width, self.dt_rank = conv_kernel, dt_rank
        self.dtype = ctx.dtype
        channels = [(intermediate_size, True)]
        self.in_proj = ShardedColumnLinear(hidden_size, [channels * 2], use_bias, ctx,
                                           f"{prefix}.in_proj")
        self.conv1d = DepthwiseConvWeight(
            self.intermediate_size, conv_kernel, ctx.dtype, use_conv_bias,
            shard_rows(channels, ctx.tp_rank, tp) if tp > 1 else None)
        self.x_proj = RowParallelLinear(intermediate_size, dt_rank + 2 * state_size, False, ctx,
                                        f"{prefix}.x_proj")
        self.dt_proj = ColumnParallelLinear(dt_rank, intermediate_size, True, ctx,
                                            f"{prefix}.dt_proj")
        self.A_log = sharded_param(intermediate_size, 0.0, ctx, state_size)
        self.D = sharded_param(intermediate_size, 1.0, ctx)
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, use_bias, ctx,
                                          f"{prefix}.out_proj")
        self.bcdt_norms = bcdt_norm_eps is not None
        if self.bcdt_norms:
            self.dt_layernorm = RMSNorm(dt_rank, bcdt_norm_eps, ctx)
            self.b_layernorm = RMSNorm(state_size, bcdt_norm_eps, ctx)
            self.c_layernorm = RMSNorm(state_size, bcdt_norm_eps, ctx)
        self.conv_op = ctx.custom_op("causal_conv1d") or recurrent_ops.causal_conv1d
        self.conv_update_op = (ctx.custom_op("causal_conv1d_update")
                               or recurrent_ops.causal_conv1d_update)
        self.scan_op = ctx.custom_op("selective_scan") or recurrent_ops.selective_scan
        self.update_op = (ctx.custom_op("selective_state_update")
                          or recurrent_ops.selective_state_update)

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The conv state in the model dtype, the SSM state in float32."""
        return [((self.intermediate_size, self.conv_width - 1), self.dtype),
                ((self.intermediate_size, self.state_size), torch.float32)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        md = get_forward_context()
        t = hidden.size(0)
        x, gate = self.in_proj(hidden).chunk(2, -1)
        A = -self.A_log.float().exp()
        conv_state, ssm_state = self.states
        nd = md.num_decode_tokens  # decodes first, one token each
        slots = md.state_indices
        rows, has = slots[nd:], md.has_initial_state[nd:]
        starts = md.query_start_loc[nd:] - nd
        xc = torch.empty_like(x)
        if nd:
            xc[:nd] = self.conv_update_op(x[:nd], conv_state, self.conv1d.weight,
                                          self.conv1d.bias, "silu", slots[:nd])
        initial = conv_state[rows]
        if nd < t:
            xc[nd:], conv_final = self.conv_op(x[nd:], self.conv1d.weight, self.conv1d.bias,
                                               starts, initial, has, "silu")
            conv_state[rows] = conv_final
        dt, B, C = self.x_proj(xc).split([self.dt_rank, self.state_size, self.state_size], -1)
        if self.bcdt_norms:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        # the bias is added in float32 by the scan, as transformers adds it
        dt = self.dt_proj.method.apply(self.dt_proj, dt, None)
        y = torch.empty_like(x)
        if nd:
            y[:nd] = self.update_op(ssm_state, xc[:nd], dt[:nd], A, B[:nd], C[:nd], self.D,
                                    gate[:nd], self.dt_proj.bias, True, slots[:nd])
            self.checkpoint_decodes(md)
        if nd < t:
            at, entries = self.prefill_checkpoints(md)
            kept = self.checkpoint_states(at)
            y[nd:], ssm_final = self.scan_op(xc[nd:], dt[nd:], A, B[nd:], C[nd:], self.D,
                                             gate[nd:], self.dt_proj.bias, True, starts,
                                             ssm_state[rows], has, checkpoint_rows=at,
                                             checkpoint_states=kept)
            ssm_state[rows] = ssm_final
            if at is not None:
                self.store(0, entries, conv_states_at(x[nd:], initial, has, starts, at))
                self.store(1, entries, kept)
        return self.out_proj(y)
