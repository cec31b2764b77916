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
weights of its own, and here each use then gets a block of its own. Checkpoint names as
transformers' (`layers.{i}.shared_transformer`, `linear`, `mamba_decoder`,
`final_layernorm`); a block's adapters for its j-th use (`*_adapter_list.{j}`) are that
hybrid layer's. Transformers clamps the step sizes to `time_step_min` from below in prefill
and not in decode; so does this model.

Tensor parallel splits the Mamba 2 layers by heads (`Mamba2Mixer`) and a shared block as
Llama's attention and MLP: q/k/v by heads, `o_proj` and `down_proj` row-parallel, the MLP's
gate and up column-parallel; each adapter's `down` is whole on every rank and its `up` gives
this rank's rows of what it is added to. Pipeline parallel gives each stage its layers and a
copy of each block they use; the original token embeddings travel to the next stage in the
place of the residual, which Zamba 2 does not keep apart from the hidden states.
"""
from __future__ import annotations

import functools
import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.distributed.pipeline import Intermediate
from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                   ReplicatedLinear, RowParallelLinear)
from runtime.layers.mamba2_mixer import Mamba2Mixer
from runtime.layers.recurrent_sharding import split
from runtime.layers.rotary import get_rope, rotary_embedding
from runtime.model_config import attention_heads
from runtime.models.llama import default_weight_loader

# the shared MLP's activation (transformers' ACT2FN name) on the gate
_ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
                "silu": F.silu}
_BLOCK = re.compile(r"model\.blocks\.(\d+)\.")
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
    """up(down(x)): transformers' `nn.Sequential` of two bias-free linears (`0`, `1`). `up`
    gives this rank's rows of each of `out_sizes` (q, k or v heads; the gate and up halves),
    as the projection it is added to holds them."""

    def __init__(self, size: int, rank: int, out_sizes: list[int], ctx: BuildContext,
                 prefix: str) -> None:
        super().__init__()
        self.down = ReplicatedLinear(size, rank, False, ctx, f"{prefix}.down")
        self.up = MergedColumnParallelLinear(rank, out_sizes, False, ctx, f"{prefix}.up")

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
        self.o_proj = RowParallelLinear(num_heads * self.head_size, hidden, False, ctx,
                                        f"{prefix}.o_proj")
        self.pre_ff_layernorm = RMSNorm(hidden, config.rms_norm_eps, ctx)
        inter, bias = config.intermediate_size, config.add_bias_linear
        split(inter, ctx.tp_size, "Zamba 2's shared MLP channels")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias, ctx,
                                                       f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(inter, hidden, bias, ctx, f"{prefix}.down_proj")
        self.act = _ACTIVATIONS[config.hidden_act]
        self.rotary_emb = (get_rope(self.head_size,
                                    ctx.max_model_len or config.max_position_embeddings,
                                    config, ctx.dtype) if config.use_mem_rope else None)
        self.rotary_op = ctx.custom_op("rotary_embedding") or rotary_embedding


class Zamba2HybridLayer(nn.Module):
    """A Mamba 2 layer, or with `block_id` set a hybrid layer: its use of that shared block
    (`block`, whose heads it attends with: adapters, `linear`, its own `attn`) before the
    mixer."""

    def __init__(self, config, ctx: BuildContext, prefix: str, block_id: int | None,
                 block: Zamba2SharedBlock | None) -> None:
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
        qkv, head_size = block.qkv_proj, block.head_size
        self.q_size, self.kv_size = qkv.num_heads * head_size, qkv.num_kv_heads * head_size
        self.attn = Attention(qkv.num_heads, head_size, (head_size / 2) ** -0.5,
                              qkv.num_kv_heads, ctx)
        self.linear = ReplicatedLinear(hidden, hidden, False, ctx, f"{prefix}.linear")
        rank, wide = config.adapter_rank, 2 * hidden
        self.qkv_adapters = None
        if config.use_shared_attention_adapter:
            self.qkv_adapters = nn.ModuleDict({
                part: LowRankAdapter(wide, rank, [wide], ctx, f"{prefix}.{part}_adapter")
                for part in "qkv"})
        inter = config.intermediate_size
        self.gate_up_adapter = LowRankAdapter(hidden, rank, [inter, inter], ctx,
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
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"Zamba 2: MLP activation {config.hidden_act!r} is not supported; "
                             f"supported: {', '.join(_ACTIVATIONS)}")
        if config.use_shared_attention_adapter and \
                config.num_key_value_heads != config.num_attention_heads:
            raise ValueError("Zamba 2: attention adapters with fewer KV heads than query heads "
                             "(transformers adds a full-width adapter to the keys and values)")
        # a pipeline stage builds its own layers and the blocks they use; the others stay
        # placeholders, so that names keep their indices
        self.start, self.end = ctx.pp.layers(config.num_hidden_layers)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
                             if ctx.pp.is_first else None)
        hybrid = list(config.hybrid_layer_ids)
        num_blocks = config.num_mem_blocks if config.tie_word_embeddings else len(hybrid)
        # layer index -> the block it runs
        self.block_of = {layer: use % num_blocks for use, layer in enumerate(hybrid)}
        used = {self.block_of[i] for i in range(self.start, self.end) if i in self.block_of}
        self.blocks = nn.ModuleList(
            Zamba2SharedBlock(config, ctx, f"model.blocks.{k}") if k in used else nn.Identity()
            for k in range(num_blocks))
        self.layers = nn.ModuleList(
            Zamba2HybridLayer(config, ctx, f"model.layers.{i}", self.block_of.get(i),
                              self.blocks[self.block_of[i]] if i in self.block_of else None)
            if self.start <= i < self.end else nn.Identity()
            for i in range(config.num_hidden_layers))
        self.final_layernorm = (RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
                                if ctx.pp.is_last else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        """A stage after the first starts from the previous one's hidden states and original
        token embeddings (`intermediate`); one before the last returns its own."""
        if intermediate is None:
            embeds = hidden = self.embed_tokens(input_ids)
        else:
            hidden, embeds = intermediate
        for layer in self.layers[self.start:self.end]:
            block = None if layer.block_id is None else self.blocks[layer.block_id]
            hidden = layer(positions, hidden, embeds, block)
        if self.final_layernorm is None:
            return hidden, embeds
        return self.final_layernorm(hidden)


class Zamba2ForCausalLM(nn.Module):
    is_hybrid = True

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.config, self.pp = config, ctx.pp
        self.model = Zamba2Model(config, ctx)
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, ctx)
                        if ctx.pp.is_last else None)
        if config.tie_word_embeddings and ctx.pp.size == 1:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        return self.model(input_ids, positions, intermediate)

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

    def _on_this_stage(self, target: str) -> bool:
        """Whether our parameter `target` is built on this pipeline stage: a block's where a
        layer of the stage uses it, whichever layer's name the checkpoint stores it under."""
        block = _BLOCK.match(target)
        if block is not None:
            return not isinstance(self.model.blocks[int(block.group(1))], nn.Identity)
        return self.pp.owns(target, self.config.num_hidden_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """A checkpoint may store a tied block again under each use: each copy lands on
        the one block (on each stage that holds it). A merged column layer (the MLP's gate
        and up, their adapter) takes the checkpoint's fused tensor part by part; with tied
        embeddings a last stage after the first loads its LM head from the embeddings."""
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        tied = self.config.tie_word_embeddings
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and tied:
                continue
            if name == "model.embed_tokens.weight" and tied and self.pp.size > 1 and \
                    self.pp.is_last:
                self.lm_head.weight.weight_loader(self.lm_head.weight, tensor)
                loaded.add("lm_head.weight")
            target, shard = self._ours(name)
            if target is None or not self._on_this_stage(target):
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}")
            param, layer = params[target], modules[target.rpartition(".")[0]]
            if shard is not None:
                param.weight_loader(param, tensor, shard)
            elif isinstance(layer, MergedColumnParallelLinear):
                for i, part in enumerate(tensor.split(layer.output_sizes)):
                    param.weight_loader(param, part, i)
            else:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        return loaded
