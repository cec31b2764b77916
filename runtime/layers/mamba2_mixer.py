"""Mamba 2's mixer (state-space duality) as transformers' `Mamba2Mixer`: one input projection
into gate, conv inputs and step sizes; a causal conv over x, B, C; the SSD scan, whose
[H, P, N] state per sequence lives in the recurrent state cache; a grouped gated RMSNorm; the
output projection. Mamba 2 itself, Bamba, Granite 4.0-H, Nemotron-H and Falcon-H1 share it
(Falcon-H1 with its muP multipliers on the input and the projection, and its own norm)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.forward_context import get_forward_context
from runtime.layers.build_context import BuildContext
from runtime.layers.gated_delta_net import DepthwiseConvWeight
from runtime.layers.linear import RowParallelLinear
from runtime.layers.recurrent_sharding import (ShardedColumnLinear, load_rows, shard_rows,
                                               sharded_param, split)
from runtime.layers.recurrent_state import StatefulLayer, conv_states_at
from runtime.plugins import recurrent_ops
from runtime.plugins.ops import gated_rms_norm


class GroupedGatedRMSNorm(nn.Module):
    """x * silu(gate), then RMSNorm over each of `groups` equal slices, as transformers'
    `MambaRMSNormGated` (norm after the gate): the `gated_rms_norm` op. With
    `norm_before_gate` the norm first, then the gate, as Falcon-H1's `FalconH1RMSNormGated`
    (its weight applied in float32, which the op does not do: computed here).

    Under tensor parallel each rank holds `size` channels of whole groups; with `tp_group`
    (one group split over the ranks, as vLLM's `Mixer2RMSNormGated`) the group's sum of
    squares is all-reduced and divided by its full width, `size` times the group's size."""

    def __init__(self, size: int, groups: int, eps: float, dtype: torch.dtype,
                 norm_before_gate: bool = False, tp_group=None, tp_size: int = 1,
                 op: Callable[..., torch.Tensor] | None = None) -> None:
        super().__init__()
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate
        self.tp_group, self.group_width = tp_group, size // groups * tp_size
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.op = op or gated_rms_norm

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None and not self.norm_before_gate:
            return self.op(x, gate, self.weight, self.eps, x.size(-1) // self.groups, False)
        h = x.float() if self.norm_before_gate else x.float() * F.silu(gate.float())
        h = h.view(x.size(0), self.groups, -1)
        if self.tp_group is None:
            variance = h.pow(2).mean(-1, keepdim=True)
        else:
            variance = self.tp_group.all_reduce(h.pow(2).sum(-1, keepdim=True)) \
                / self.group_width
        h = (h * torch.rsqrt(variance + self.eps)).view(x.shape)
        if self.norm_before_gate:
            return (self.weight.float() * h * F.silu(gate.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class Mamba2Mixer(StatefulLayer):
    """Checkpoint names as transformers': `in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`,
    `norm`, `out_proj`. The sizes are keywords: each architecture names them its own way in
    its config (`mamba_*` in the hybrids).

    Falcon-H1's parts: `norm` None gates the scan's output by silu(gate) without a norm;
    `norm_before_gate` orders the norm's steps; `input_multiplier` scales the input,
    `projection_multipliers` the input projection's gate, x, B, C and dt parts;
    `out_proj_bias` (default `use_bias`) is the output projection's own bias setting."""

    def __init__(self, ctx: BuildContext, prefix: str, *, hidden_size: int, num_heads: int,
                 head_dim: int, n_groups: int, state_size: int, conv_kernel: int,
                 intermediate_size: int, use_conv_bias: bool, use_bias: bool, eps: float,
                 chunk_size: int, time_step_limit: tuple[float, float], norm: bool = True,
                 norm_before_gate: bool = False, input_multiplier: float = 1.0,
                 projection_multipliers: list[float] | None = None,
                 out_proj_bias: bool | None = None) -> None:
        super().__init__()
        if num_heads * head_dim != intermediate_size:
            raise ValueError(f"Mamba 2: num_heads {num_heads} x head_dim {head_dim} must equal "
                             f"the intermediate size {intermediate_size}")
        tp, rank = ctx.tp_size, ctx.tp_rank
        # Whole heads per rank; B and C groups split with them, or (one group) replicated.
        self.num_heads = split(num_heads, tp, "Mamba 2 heads")
        if n_groups % tp and n_groups != 1:
            raise ValueError(f"tensor parallel: Mamba 2's {n_groups} groups of B and C neither "
                             f"split over tensor-parallel size {tp} nor are one group that "
                             "every rank can hold whole")
        groups_split = n_groups % tp == 0
        self.head_dim, self.state_size = head_dim, state_size
        self.n_groups = n_groups // tp if groups_split else n_groups
        self.intermediate_size = intermediate_size // tp
        gn = n_groups * state_size
        xbc = [(intermediate_size, True), (gn, groups_split), (gn, groups_split)]
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * state_size
        self.conv_width = conv_kernel
        self.chunk_size = chunk_size
        self.dt_limit = tuple(float(v) for v in time_step_limit)
        self.dtype = ctx.dtype
        self.in_proj = ShardedColumnLinear(
            hidden_size, [[(intermediate_size, True), *xbc, (num_heads, True)]], use_bias, ctx,
            f"{prefix}.in_proj")
        self.conv1d = DepthwiseConvWeight(self.conv_dim, conv_kernel, ctx.dtype, use_conv_bias,
                                          shard_rows(xbc, rank, tp) if tp > 1 else None)
        self.dt_bias = sharded_param(num_heads, 1.0, ctx)
        self.A_log = sharded_param(num_heads, 0.0, ctx)
        self.D = sharded_param(num_heads, 1.0, ctx)
        self.norm = None
        if norm:
            spans_ranks = tp > 1 and not groups_split
            self.norm = GroupedGatedRMSNorm(
                self.intermediate_size, self.n_groups, eps, ctx.dtype, norm_before_gate,
                ctx.tp_group if spans_ranks else None, tp if spans_ranks else 1,
                ctx.custom_op("gated_rms_norm"))
            load_rows(self.norm.weight, shard_rows([(intermediate_size, True)], rank, tp)
                      if tp > 1 else None)
        self.out_proj = RowParallelLinear(
            intermediate_size, hidden_size, use_bias if out_proj_bias is None else out_proj_bias,
            ctx, f"{prefix}.out_proj")
        self.input_multiplier = input_multiplier
        multipliers = None
        if projection_multipliers is not None:
            gn = self.n_groups * state_size
            parts = [self.intermediate_size, self.intermediate_size, gn, gn, self.num_heads]
            multipliers = torch.cat([torch.full((n,), float(m), dtype=ctx.dtype)
                                     for n, m in zip(parts, projection_multipliers)])
        self.register_buffer("projection_multipliers", multipliers, persistent=False)
        self.conv_op = ctx.custom_op("causal_conv1d") or recurrent_ops.causal_conv1d
        self.conv_update_op = (ctx.custom_op("causal_conv1d_update")
                               or recurrent_ops.causal_conv1d_update)
        self.scan_op = ctx.custom_op("mamba2_chunk_scan") or recurrent_ops.mamba2_chunk_scan
        self.update_op = (ctx.custom_op("mamba2_state_update")
                          or recurrent_ops.mamba2_state_update)

    @classmethod
    def from_hybrid_config(cls, config, ctx: BuildContext, prefix: str) -> "Mamba2Mixer":
        """The mixer of a hybrid whose config names its sizes `mamba_*` (Granite 4.0-H,
        Bamba)."""
        return cls(ctx, prefix, hidden_size=config.hidden_size, num_heads=config.mamba_n_heads,
                   head_dim=config.mamba_d_head, n_groups=config.mamba_n_groups,
                   state_size=config.mamba_d_state, conv_kernel=config.mamba_d_conv,
                   intermediate_size=int(config.mamba_expand * config.hidden_size),
                   use_conv_bias=config.mamba_conv_bias, use_bias=config.mamba_proj_bias,
                   eps=config.rms_norm_eps, chunk_size=config.mamba_chunk_size,
                   time_step_limit=config.time_step_limit)

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The conv state in the model dtype, the SSM state in float32."""
        return [((self.conv_dim, self.conv_width - 1), self.dtype),
                ((self.num_heads, self.head_dim, self.state_size), torch.float32)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        md = get_forward_context()
        t = hidden.size(0)
        if self.input_multiplier != 1.0:
            hidden = hidden * self.input_multiplier
        projected = self.in_proj(hidden)
        if self.projection_multipliers is not None:
            projected = projected * self.projection_multipliers
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads],
                                        -1)
        A = -self.A_log.float().exp()
        conv_state, ssm_state = self.states
        nd = md.num_decode_tokens  # decodes first, one token each
        slots = md.state_indices
        y = torch.empty(t, self.num_heads, self.head_dim, dtype=hidden.dtype,
                        device=hidden.device)
        if nd:
            x = self.conv_update_op(xbc[:nd], conv_state, self.conv1d.weight, self.conv1d.bias,
                                    "silu", slots[:nd])
            x, B, C = self._split(x)
            # dt is not clamped to the limit in decode, as neither transformers nor
            # mamba_ssm's selective_state_update clamps it there
            y[:nd] = self.update_op(ssm_state, x, dt[:nd], A, B, C, self.D, self.dt_bias, True,
                                    slots[:nd])
            self.checkpoint_decodes(md)
        if nd < t:
            rows, has = slots[nd:], md.has_initial_state[nd:]
            starts = md.query_start_loc[nd:] - nd
            at, entries = self.prefill_checkpoints(md)
            initial = conv_state[rows]
            x, conv_final = self.conv_op(xbc[nd:], self.conv1d.weight, self.conv1d.bias, starts,
                                         initial, has, "silu")
            conv_state[rows] = conv_final
            x, B, C = self._split(x)
            kept = self.checkpoint_states(at)
            y[nd:], ssm_final = self.scan_op(x, dt[nd:], A, B, C, self.D, self.dt_bias, True,
                                             starts, ssm_state[rows], has, self.chunk_size,
                                             self.dt_limit, checkpoint_rows=at,
                                             checkpoint_states=kept)
            ssm_state[rows] = ssm_final
            if at is not None:
                self.store(0, entries, conv_states_at(xbc[nd:], initial, has, starts, at))
                self.store(1, entries, kept)
        y = y.view(t, -1)
        return self.out_proj(y * F.silu(gate) if self.norm is None else self.norm(y, gate))

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gn = self.n_groups * self.state_size
        x, B, C = x.split([self.intermediate_size, gn, gn], -1)
        t = x.size(0)
        return (x.view(t, self.num_heads, self.head_dim),
                B.view(t, self.n_groups, self.state_size),
                C.view(t, self.n_groups, self.state_size))
