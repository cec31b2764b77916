"""The recurrent layers split over two tensor-parallel ranks against the same layer whole, in
process: each rank loads its rows of the whole layer's tensors, and the two run as threads whose
all-reduce sums their partial results. A prefill of two sequences, then a decode of each, must
give the whole layer's output on both ranks, and each rank's state its share of the whole's."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import Zamba2Config

from runtime.forward_context import forward_context
from runtime.layers.build_context import BuildContext
from runtime.layers.gated_delta_net import GatedDeltaNet
from runtime.layers.kimi_delta_attention import KimiDeltaAttention
from runtime.layers.mamba2_mixer import Mamba2Mixer
from runtime.layers.mamba_mixer import MambaMixer
from runtime.models.lfm2 import ShortConv
from runtime.models.llama import default_weight_loader
from runtime.models.zamba2 import Zamba2SharedBlock

HIDDEN = 32
TP = 2


class ThreadGroup:
    """An all-reduce between threads, one per rank: each adds its tensor, all read the sum."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.parts: list[torch.Tensor | None] = [None] * size

    def rank(self, rank: int) -> SimpleNamespace:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()
            return total
        return SimpleNamespace(all_reduce=all_reduce)


def _ctx(rank: int = 0, size: int = 1, group=None) -> BuildContext:
    return BuildContext(dtype=torch.float32, device=torch.device("cpu"), attention_backend=None,
                        tp_rank=rank, tp_size=size, tp_group=group)


def _gdn(ctx):
    config = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=8, linear_value_head_dim=8,
                             linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
                             hidden_size=HIDDEN)
    return GatedDeltaNet(config, ctx, "gdn")


def _mamba2(groups: int, **falcon_h1):
    def build(ctx):
        return Mamba2Mixer(ctx, "m2", hidden_size=HIDDEN, num_heads=4, head_dim=16,
                           n_groups=groups, state_size=8, conv_kernel=4, intermediate_size=64,
                           use_conv_bias=True, use_bias=False, eps=1e-5, chunk_size=4,
                           time_step_limit=(0.0, float("inf")), **falcon_h1)
    return build


def _kda(ctx, heads: int = 4):
    config = SimpleNamespace(linear_num_heads=heads, linear_head_dim=8, linear_conv_kernel_dim=4,
                             hidden_act="silu", rms_norm_eps=1e-6, hidden_size=HIDDEN)
    return KimiDeltaAttention(config, ctx, "kda")


def _mamba(ctx):
    return MambaMixer(ctx, "m1", hidden_size=HIDDEN, intermediate_size=64, state_size=8,
                      conv_kernel=4, dt_rank=4, use_conv_bias=True, use_bias=True,
                      activation="silu", bcdt_norm_eps=1e-6)


def _short_conv(ctx):
    config = SimpleNamespace(hidden_size=HIDDEN, conv_L_cache=3, conv_bias=True)
    return ShortConv(config, ctx, "conv")


LAYERS = {"gated-delta-net": _gdn, "kimi-delta-attention": _kda, "mamba2-split-groups": _mamba2(2),
          "mamba2-one-group": _mamba2(1),
          # Falcon-H1's: the norm before the gate, muP multipliers on the input and each part
          "mamba2-falcon-h1": _mamba2(1, norm_before_gate=True, input_multiplier=0.7,
                                      projection_multipliers=[0.5, 1.5, 2.0, 0.7, 1.2]),
          "mamba": _mamba, "short-conv": _short_conv}


def _load(layer, whole) -> None:
    """Load `layer` from `whole`'s tensors as a checkpoint gives them (the gated delta-net's
    fused input projection as its four checkpoint tensors, KDA's conv as its q, k and v
    convs)."""
    params = dict(layer.named_parameters())
    for name, tensor in whole.named_parameters():
        param = params[name]
        if isinstance(whole, GatedDeltaNet) and name == "in_proj.weight":
            sizes = [rows.numel() for rows in whole.in_proj.shard_rows]
            for shard_id, part in enumerate(tensor.data.split(sizes)):
                param.weight_loader(param, part, shard_id)
        elif isinstance(whole, KimiDeltaAttention) and name == "conv1d.weight":
            for part, conv in zip("qkv", tensor.data.chunk(3)):
                layer.load_conv(part, conv.unsqueeze(1))
        else:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor.data)


def _allocate(layer, slots: int) -> None:
    layer.states = [torch.zeros(slots, *shape, dtype=dtype)
                    for shape, dtype in layer.state_shapes()]


def _steps(layer, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A prefill of 5 and 7 tokens in slots 1 and 0, then a decode of each."""
    prefill = SimpleNamespace(num_decode_tokens=0, state_indices=torch.tensor([1, 0]),
                              has_initial_state=torch.tensor([False, False]),
                              query_start_loc=torch.tensor([0, 5, 12]), checkpoint_rows=None,
                              num_decode_checkpoints=0)
    decode = SimpleNamespace(num_decode_tokens=2, state_indices=torch.tensor([1, 0]),
                             has_initial_state=torch.tensor([True, True]),
                             query_start_loc=torch.tensor([0, 1, 2]), checkpoint_rows=None,
                             num_decode_checkpoints=0)
    outs = []
    for md, x in zip((prefill, decode), inputs):
        with forward_context(md):
            outs.append(layer(x))
    return outs


@pytest.mark.parametrize("name", list(LAYERS))
def test_two_ranks_equal_the_whole_layer(name):
    torch.manual_seed(0)
    build = LAYERS[name]
    whole = build(_ctx())
    for param in whole.parameters():
        param.data.normal_(0, 0.3)
    _allocate(whole, 2)
    inputs = [torch.randn(12, HIDDEN), torch.randn(2, HIDDEN)]
    with torch.no_grad():
        expected = _steps(whole, inputs)

    group = ThreadGroup(TP)
    ranks = [build(_ctx(r, TP, group.rank(r))) for r in range(TP)]
    results: list = [None] * TP

    def run(r: int) -> None:
        _load(ranks[r], whole)
        _allocate(ranks[r], 2)
        with torch.no_grad():
            results[r] = _steps(ranks[r], inputs)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(TP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for outs in results:
        for ours, ref in zip(outs, expected):
            torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    # the split parts of every state are shared out; only Mamba 2's one group is held whole
    for i, state in enumerate(whole.states):
        shares = sum(rank.states[i][0].numel() for rank in ranks)
        if not name.endswith(("one-group", "falcon-h1")) or i == 1:
            assert shares == state[0].numel()
        else:
            assert state[0].numel() < shares < TP * state[0].numel()


@pytest.mark.parametrize("build, named", [
    (lambda ctx: _mamba2(3)(ctx), "Mamba 2's 3 groups of B and C neither split"),
    (lambda ctx: Mamba2Mixer(ctx, "m2", hidden_size=HIDDEN, num_heads=3, head_dim=16,
                             n_groups=1, state_size=8, conv_kernel=4, intermediate_size=48,
                             use_conv_bias=True, use_bias=False, eps=1e-5, chunk_size=4,
                             time_step_limit=(0.0, float("inf"))),
     r"Mamba 2 heads \(3\) do not split over tensor-parallel size 2"),
    (lambda ctx: _kda(ctx, heads=3),
     r"Kimi delta attention heads \(3\) do not split over tensor-parallel size 2"),
    # the gate and up halves would split, each rank's share of both not
    (lambda ctx: Zamba2SharedBlock(Zamba2Config(hidden_size=HIDDEN, num_attention_heads=4,
                                                intermediate_size=33), ctx, "block"),
     r"Zamba 2's shared MLP channels \(33\) do not split over tensor-parallel size 2"),
])
def test_shapes_that_do_not_split_are_refused(build, named):
    with pytest.raises(ValueError, match=named):
        build(_ctx(0, TP, ThreadGroup(TP).rank(0)))
