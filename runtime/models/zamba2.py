"""Zamba 2 (`Zamba2ForCausalLM`): a stack of Mamba 2 layers, some of them (`hybrid` in the
config's `layers_block_type`) preceded by a shared attention + MLP block.

A Mamba layer is h + mixer(norm(h)). A hybrid layer first runs one of `num_mem_blocks`
shared blocks (its k-th hybrid layer the block k % num_mem_blocks) on the concatenation of h
and the original token embeddings [2 hidden]: norm, attention over heads of 2 hidden / heads
(scale (head_dim / 2) ** -0.5, rope only with `use_mem_rope`), norm, a gated MLP; no residual
inside. Each use adds its own low-rank adapters (`use_shared_attention_adapter`: to q, k and
v; always: to the MLP's gate and up) and its own `linear`; the result is added to the Mamba
layer's input, not to its residual: h + mixer(norm(h + linear(block(h, embeds)))).

The shared block's weights are stored once (`model.blocks.{k}`); each use has its own
`Attention`, so each keeps its own KV cache layer. Transformers ties the uses of a block only
with `tie_word_embeddings` (its weight tying hangs on that flag): without it every use keeps
weights of its own, and here each use then gets a block of its own. Checkpoint names as transformers'
(`layers.{i}.shared_transformer`, `linear`, `mamba_decoder`, `final_layernorm`); a block's
adapters for its j-th use (`*_adapter_list.{j}`) are that hybrid layer's. Transformers
clamps the step sizes to `time_step_min` from below in prefill and not in decode; so does
this model.
"""
from __future__ import annotations

import functools
import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import QKVParallelLinear, ReplicatedLinear
from runtime.layers.mamba2_mixer import Mamba2Mixer
from runtime.layers.rotary import get_rope, rotary_embedding
from runtime.model_config import attention_heads
from runtime.models.llama import default_weight_loader

# the shared MLP's activation (transformers' ACT2FN name) on the gate
_ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
                "silu": F.silu}
_SHARED = re.compile(r"model\.layers\.(\d+)\.shared_transformer\.(.*)$")
_ADAPTER = re.compile(r"(self_attn\.linear_([qkv])_adapter_list|feed_forward\."
                      r"gate_up_proj_adapter_list)\.(\d+)\.([01])\.weight$")
# a shared block's checkpoint names -> ours (and the q/k/v shard)
_BLOCK_NAMES = {"self_attn.q_proj.weight": ("qkv_proj.weight", "q"),
                "self_attn.k_proj.weight": ("qkv_proj.weight", "k"),
                "self_attn.v_proj.weight": ("qkv_proj.weight", "v"),
                "self_attn.o_proj.weight": ("o_proj.weight", None),
                "feed_forward.gate_up_proj.weight": ("gate_up_proj.weight", None),
                "feed_forward.gate_up_proj.bias": ("gate_up_proj.bias", None),
                "feed_forward.down_proj.weight": ("down_proj.weight", None),
                "feed_forward.down_proj.bias": ("down_proj.bias", None),
                "input_layernorm.weight": ("input_layernorm.weight", None),
                "pre_ff_layernorm.weight": ("pre_ff_layernorm.weight", None)}


class LowRankAdapter(nn.Module):
    """up(down(x)): transformers' `nn.Sequential` of two bias-free linears (`0`, `1`)."""

    def __init__(self, size: int, rank: int, out_size: int, ctx: BuildContext,
                 prefix: str) -> None:
        super().__init__()
        self.down = ReplicatedLinear(size, rank, False, ctx, f"{prefix}.down")
        self.up = ReplicatedLinear(rank, out_size, False, ctx, f"{prefix}.up")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class Zamba2SharedBlock(nn.Module):
    """The weights of one shared attention + MLP block; a hybrid layer runs it with its own
    adapters and attention (`Zamba2HybridLayer.run_block`)."""

    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        hidden, wide = config.hidden_size, 2 * config.hidden_size
        num_heads, num_kv_heads, self.head_size = attention_heads(config)
        self.input_layernorm = RMSNorm(wide, config.rms_norm_eps, ctx)
        self.qkv_proj = QKVParallelLinear(wide, self.head_size, num_heads, num_kv_heads, False,
                                          ctx, f"{prefix}.qkv_proj")
        self.o_proj = ReplicatedLinear(num_heads * self.head_size, hidden, False, ctx,
                                       f"{prefix}.o_proj")
        self.pre_ff_layernorm = RMSNorm(hidden, config.rms_norm_eps, ctx)
        inter, bias = config.intermediate_size, config.add_bias_linear
        self.gate_up_proj = ReplicatedLinear(hidden, 2 * inter, bias, ctx,
                                             f"{prefix}.gate_up_proj")
        self.down_proj = ReplicatedLinear(inter, hidden, bias, ctx, f"{prefix}.down_proj")
        self.act = _ACTIVATIONS[config.hidden_act]
        self.rotary_emb = (get_rope(self.head_size,
                                    ctx.max_model_len or config.max_position_embeddings,
                                    config, ctx.dtype) if config.use_mem_rope else None)
        self.rotary_op = ctx.custom_op("rotary_embedding") or rotary_embedding


class Zamba2HybridLayer(nn.Module):
    """A Mamba 2 layer, or with `block_id` set a hybrid layer: its shared block's use
    (adapters, `linear`, its own `attn`) before the mixer."""

    def __init__(self, config, ctx: BuildContext, prefix: str, block_id: int | None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.block_id = block_id
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, ctx)
        self.mamba = Mamba2Mixer(
            ctx, f"{prefix}.mamba", hidden_size=hidden, num_heads=config.n_mamba_heads,
            head_dim=config.mamba_headdim, n_groups=config.mamba_ngroups,
            state_size=config.mamba_d_state, conv_kernel=config.mamba_d_conv,
            intermediate_size=int(config.mamba_expand * hidden),
            use_conv_bias=True,  # transformers builds the conv with a bias whatever the config
            use_bias=config.add_bias_linear, eps=1e-5, chunk_size=config.chunk_size,
            time_step_limit=(config.time_step_min, float("inf")))
        if block_id is None:
            return
        num_heads, num_kv_heads, head_size = attention_heads(config)
        self.q_size, self.kv_size = num_heads * head_size, num_kv_heads * head_size
        self.attn = Attention(num_heads, head_size, (head_size / 2) ** -0.5, num_kv_heads, ctx)
        self.linear = ReplicatedLinear(hidden, hidden, False, ctx, f"{prefix}.linear")
        rank, wide = config.adapter_rank, 2 * hidden
        self.qkv_adapters = None
        if config.use_shared_attention_adapter:
            self.qkv_adapters = nn.ModuleDict({
                part: LowRankAdapter(wide, rank, wide, ctx, f"{prefix}.{part}_adapter")
                for part in "qkv"})
        self.gate_up_adapter = LowRankAdapter(hidden, rank, 2 * config.intermediate_size, ctx,
                                              f"{prefix}.gate_up_adapter")

    def run_block(self, block: Zamba2SharedBlock, positions: torch.Tensor,
                  hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        x = block.input_layernorm(torch.cat([hidden, embeds], dim=-1))
        qkv = block.qkv_proj(x)
        if self.qkv_adapters is not None:
            qkv = qkv + torch.cat([self.qkv_adapters[part](x) for part in "qkv"], dim=-1)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], -1)
        if block.rotary_emb is not None:
            q, k = block.rotary_op(positions, q, k, block.rotary_emb.cos_sin_cache,
                                   block.head_size)
        h = block.pre_ff_layernorm(block.o_proj(self.attn(q, k, v)))
        gate, up = (block.gate_up_proj(h) + self.gate_up_adapter(h)).chunk(2, dim=-1)
        return self.linear(block.down_proj(block.act(gate) * up))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, embeds: torch.Tensor,
                block: Zamba2SharedBlock | None) -> torch.Tensor:
        x = hidden if block is None else hidden + self.run_block(block, positions, hidden,
                                                                 embeds)
        return hidden + self.mamba(self.input_layernorm(x))


class Zamba2Model(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        if ctx.pp.size > 1 or ctx.tp_size > 1:
            raise ValueError("tensor and pipeline parallel are not supported for Zamba 2 yet "
                             "(its shared blocks' attention output and adapters are not split "
                             "across ranks)")
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"Zamba 2: MLP activation {config.hidden_act!r} is not supported; "
                             f"supported: {', '.join(_ACTIVATIONS)}")
        if config.use_shared_attention_adapter and \
                config.num_key_value_heads != config.num_attention_heads:
            raise ValueError("Zamba 2: attention adapters with fewer KV heads than query heads "
                             "(transformers adds a full-width adapter to the keys and values)")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
        hybrid = list(config.hybrid_layer_ids)
        num_blocks = config.num_mem_blocks if config.tie_word_embeddings else len(hybrid)
        self.blocks = nn.ModuleList(Zamba2SharedBlock(config, ctx, f"model.blocks.{k}")
                                    for k in range(num_blocks))
        # layer index -> the block it runs
        self.block_of = {layer: use % num_blocks for use, layer in enumerate(hybrid)}
        self.layers = nn.ModuleList(
            Zamba2HybridLayer(config, ctx, f"model.layers.{i}", self.block_of.get(i))
            for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeds = hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            block = None if layer.block_id is None else self.blocks[layer.block_id]
            hidden = layer(positions, hidden, embeds, block)
        return self.final_layernorm(hidden)


class Zamba2ForCausalLM(nn.Module):
    is_hybrid = True

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.config = config
        self.model = Zamba2Model(config, ctx)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def _ours(self, name: str) -> tuple[str | None, str | None]:
        """Our parameter for checkpoint tensor `name` (None: one that transformers does not
        use either), and its q/k/v shard."""
        shared = _SHARED.match(name)
        if shared is None:
            return name.replace(".mamba_decoder.", "."), None
        layer, rest = int(shared.group(1)), shared.group(2)
        hybrid, block_of = list(self.config.hybrid_layer_ids), self.model.block_of
        adapter = _ADAPTER.match(rest)
        if adapter is not None:
            # the adapters of use j of this layer's block; a block used once (untied) also
            # holds, unused, those of the other uses its number comes back for
            _, part, use, which = adapter.groups()
            owner = hybrid[int(use)]
            if block_of[owner] != block_of[layer]:
                return None, None
            module = f"qkv_adapters.{part}" if part else "gate_up_adapter"
            return f"model.layers.{owner}.{module}.{('down', 'up')[int(which)]}.weight", None
        if rest not in _BLOCK_NAMES:
            raise ValueError(f"checkpoint tensor {name!r} has no place in Zamba2ForCausalLM")
        ours, shard = _BLOCK_NAMES[rest]
        return f"model.blocks.{block_of[layer]}.{ours}", shard

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """A checkpoint may store a tied block again under each use: each copy lands on
        the one block."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = self._ours(name)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}")
            param = params[target]
            if shard is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(target)
        return loaded
