"""A mixture-of-experts layer: top-k routing, then every expert's gated-silu MLP in one op.

The experts' weights live stacked, `w13` [E, 2I, H] (gate | up) and `w2` [E, H, I], so the
`fused_moe` op (`runtime.plugins.ops.fused_moe`, replaceable through `runtime_custom_op`) runs
them all at once. Under tensor parallel each rank holds every expert's share of the
intermediate dimension (columns of gate/up, rows of down); under expert parallel
(`ctx.ep_size` > 1, vLLM's `enable_expert_parallel`) rank r holds whole experts
[r * E / ep, (r + 1) * E / ep) and runs them for every token routed to them. Either way the
partial outputs are summed over the tensor-parallel group, as the dense MLP does.

`RUNTIME_MOE_IMPL=naive` (read when the layer is built; default `fused`) swaps the op for
`naive_moe`, a per-expert loop of three separate GEMMs in the style of transformers' eager
MoE blocks: the unfused baseline of `docs/benchmarks.md`. Experts gated by another activation
(Gemma 4's gelu-tanh) always run `naive_moe` with it: the `fused_moe` op is silu-only.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.linear import divide
from runtime.plugins.ops import fused_moe


SCORING_FUNCS = ("softmax", "sigmoid")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (float32), the top-k of them, optionally renormalised to sum
    to 1: (weights [T, k] float32, expert ids [T, k]). `scoring` "sigmoid" (Llama 4): the
    top-k logits instead, each through a sigmoid."""
    if scoring == "sigmoid":
        logits, ids = torch.topk(router_logits.float(), top_k, dim=-1)
        return torch.sigmoid(logits), ids
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def naive_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """As `runtime.plugins.ops.fused_moe`, the unfused way: for each expert, find its tokens,
    then gate, up and down as three GEMMs; `act` on the gate (silu unless given)."""
    out = torch.zeros_like(hidden)
    inter = w2.size(2)
    for expert in range(w13.size(0)):
        token, slot = torch.where(topk_ids == expert)
        if token.numel():
            x = hidden[token]
            gate, up = w13[expert, :inter], w13[expert, inter:]
            y = (act(x @ gate.t()) * (x @ up.t())) @ w2[expert].t()
            out.index_add_(0, token, y * topk_weights[token, slot, None].to(y.dtype))
    return out


# expert activations other than silu, which the `fused_moe` op does not take: they run
# `naive_moe` with the activation on the gate
EXPERT_ACTIVATIONS = {"gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def moe_op(ctx: BuildContext, activation: str = "silu"):
    """The experts' op: the platform's `fused_moe`, else the portable one; `naive_moe` under
    RUNTIME_MOE_IMPL=naive, and for an `activation` other than silu."""
    impl = os.environ.get("RUNTIME_MOE_IMPL", "fused")
    if impl not in ("fused", "naive"):
        raise ValueError(f"RUNTIME_MOE_IMPL must be 'fused' or 'naive', got {impl!r}")
    if activation != "silu":
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"MoE expert activation {activation!r} is not supported; "
                             f"supported: silu, {', '.join(EXPERT_ACTIVATIONS)}")
        return functools.partial(naive_moe, act=EXPERT_ACTIVATIONS[activation])
    return naive_moe if impl == "naive" else ctx.custom_op("fused_moe") or fused_moe


class FusedMoE(nn.Module):
    """Experts only; the router (a linear layer of the model) hands in its logits.

    `scoring`: how the logits become weights (`route`). `apply_router_weight_on_input`
    (Llama 4): each token enters each chosen expert scaled by that expert's weight, and the
    experts' outputs are summed unweighted, instead of weighting the outputs. `activation`:
    the gate's (`EXPERT_ACTIVATIONS` besides silu)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, ctx: BuildContext, scoring: str = "softmax",
                 apply_router_weight_on_input: bool = False, activation: str = "silu") -> None:
        super().__init__()
        if scoring not in SCORING_FUNCS:
            raise ValueError(f"MoE scoring {scoring!r} is not supported; supported: "
                             f"{', '.join(SCORING_FUNCS)}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.scoring, self.apply_router_weight_on_input = scoring, apply_router_weight_on_input
        self.tp_rank, self.tp_size, self.tp_group = ctx.tp_rank, ctx.tp_size, ctx.tp_group
        expert_map = None  # global expert id -> local id, -1 where another rank holds it
        if ctx.ep_size > 1:
            if num_experts % ctx.ep_size:
                raise ValueError(f"{num_experts} experts are not divisible by the "
                                 f"expert-parallel size {ctx.ep_size}")
            local = num_experts // ctx.ep_size
            self.first_expert, self.num_local_experts = ctx.tp_rank * local, local
            self.shard = intermediate_size
            expert_map = torch.full((num_experts,), -1, dtype=torch.long)
            expert_map[self.first_expert:self.first_expert + local] = torch.arange(local)
        else:
            self.first_expert, self.num_local_experts = 0, num_experts
            self.shard = divide(intermediate_size, ctx.tp_size)
        self.register_buffer("expert_map", expert_map, persistent=False)
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * self.shard, hidden_size, dtype=ctx.dtype),
            requires_grad=False)
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, self.shard, dtype=ctx.dtype),
            requires_grad=False)
        self.op = moe_op(ctx, activation)

    def _weighted_inputs(self, hidden: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor) -> torch.Tensor:
        """Every (token, chosen expert) pair as its own row, the token scaled by the weight,
        through the op with weight 1; then each token's rows summed."""
        t, k = ids.shape
        rows = hidden.repeat_interleave(k, dim=0) * weights.reshape(-1, 1).to(hidden.dtype)
        ones = torch.ones(t * k, 1, dtype=weights.dtype, device=weights.device)
        out = self.op(rows, self.w13_weight, self.w2_weight, ones, ids.reshape(-1, 1))
        return out.view(t, k, -1).sum(dim=1)

    def load_expert(self, param: nn.Parameter, loaded: torch.Tensor, expert: int,
                    part: str) -> None:
        """One expert's checkpoint tensor: part "gate" or "up" ([I, H]) into w13, "down"
        ([H, I]) into w2; under expert parallel only this rank's experts, whole, else this
        rank's slice of the intermediate dimension."""
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        lo = 0 if self.expert_map is not None else self.tp_rank * self.shard
        if part == "down":
            param.data[local].copy_(loaded[:, lo:lo + self.shard])
        else:
            offset = 0 if part == "gate" else self.shard
            param.data[local, offset:offset + self.shard].copy_(loaded[lo:lo + self.shard])

    def load_stacked(self, loaded: torch.Tensor, part: str) -> None:
        """Every expert's tensor at once, as transformers 5 stacks them: part "gate_up"
        ([E, 2I, H], gate then up) into w13, "down" ([E, H, I]) into w2."""
        for expert in range(loaded.size(0)):
            if part == "down":
                self.load_expert(self.w2_weight, loaded[expert], expert, "down")
            else:
                gate, up = loaded[expert].chunk(2, dim=0)
                self.load_expert(self.w13_weight, gate, expert, "gate")
                self.load_expert(self.w13_weight, up, expert, "up")

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.run_routed(hidden, *route(router_logits, self.top_k, self.renormalize,
                                              self.scoring))

    def run_routed(self, hidden: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
        """The experts on tokens a model routed itself: `weights` [T, k] float32 (applied to
        each expert's output as given), global expert `ids` [T, k]."""
        if self.expert_map is not None:
            ids = self.expert_map[ids]
        if self.apply_router_weight_on_input:
            out = self._weighted_inputs(hidden, weights, ids)
        else:
            out = self.op(hidden, self.w13_weight, self.w2_weight, weights, ids)
        if self.tp_size > 1:
            out = self.tp_group.all_reduce(out)
        return out
