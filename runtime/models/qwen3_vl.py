"""Qwen3-VL (`Qwen3VLForConditionalGeneration`): Qwen2-VL's ViT layout (temporal patch, 2-D
rotary, patch merger) with a learned position table resampled (bilinear, corners aligned) to
each image's grid and a gelu MLP; DeepStack: the outputs of `deepstack_visual_indexes`
layers, each through a merger of its own, are added to the language model's hidden states
at the image's tokens after its first layers; and a Qwen3 language model with interleaved
M-RoPE.

The encoder gives each image token [main | deepstack 1 | … | deepstack k] in one row, kept
so in the encoder cache; `embed_input_ids` gives text tokens the same width (zeros after the
embedding), so the worker merges the rows as for any model, and `forward` splits them. A
text token's deepstack part is zero: adding it changes nothing, as transformers adds at the
image tokens only. Images only (no video), one rank.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from runtime.forward_context import forward_context
from runtime.layers.build_context import BuildContext
from runtime.layers.linear import ReplicatedLinear
from runtime.models.qwen import Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from runtime.models.qwen2_vl import (PatchMerger, Qwen2VLForConditionalGeneration,
                                     VisionBlock, VisionMlp, vision_rotary, frames,
                                     mrope_op, patch_rows_cols)


def bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two rows of a `side`-long table that position `index` of an axis of `size`
    samples with corners aligned, and their weights ([N, 2] each)."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class Qwen3VisionTransformer(nn.Module):
    """Patches [N, channels * temporal_patch * patch * patch] -> [N / merge**2,
    out hidden * (1 + deepstack layers)]."""

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        dim = config.hidden_size
        self.merge = config.spatial_merge_size
        patch = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.patch_embed = ReplicatedLinear(patch, dim, True, ctx)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, dim)
        self.side = int(config.num_position_embeddings ** 0.5)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary = vision_rotary(dim // config.num_heads, theta, ctx)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, config.num_heads, VisionMlp(dim, config.intermediate_size,
                                                         config.hidden_act, ctx),
                        self.rotary, ctx, rms=False)
            for _ in range(config.depth))
        out = config.out_hidden_size
        self.merger = PatchMerger(out, dim, self.merge, ctx, False)
        self.deepstack_layers = list(getattr(config, "deepstack_visual_indexes", None) or ())
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(out, dim, self.merge, ctx, False, postshuffle=True)
            for _ in self.deepstack_layers)
        self.to(ctx.dtype)  # torch.nn layers are made in float32

    def positions(self, rows_cols: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """The learned position table resampled at each patch [N, dim]."""
        sizes = torch.tensor([[h, w] for t, h, w in grids for _ in range(t * h * w)],
                             device=rows_cols.device).T
        h_taps, h_weights = bilinear_taps(rows_cols[0], sizes[0], self.side)
        w_taps, w_weights = bilinear_taps(rows_cols[1], sizes[1], self.side)
        index = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, 4)
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weights[:, :, None].to(self.pos_embed.weight.dtype)
                ).sum(1)

    def forward(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        rows_cols = torch.from_numpy(patch_rows_cols(grids, self.merge)).to(x.device)
        x = x + self.positions(rows_cols, grids).to(x.dtype)
        table = self.rotary.table(rows_cols)
        deepstack = []
        with forward_context(frames(grids, x.device)):
            for i, block in enumerate(self.blocks):
                x = block(x, table)
                if i in self.deepstack_layers:
                    merger = self.deepstack_merger_list[self.deepstack_layers.index(i)]
                    deepstack.append(merger(x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)


class Qwen3VLAttention(Qwen3Attention):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__(config, layer_idx, ctx, prefix)
        self.rotary_op = mrope_op(self, config, [24, 20, 20], interleaved=True)


class Qwen3VLDecoderLayer(Qwen3DecoderLayer):
    attention_cls = Qwen3VLAttention


class Qwen3VLTextModel(Qwen3Model):
    layer_cls = Qwen3VLDecoderLayer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate=None, inputs_embeds: torch.Tensor | None = None,
                deepstack: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """`deepstack[i]` [T, hidden] is added to the hidden states after layer i."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual)
            if i < len(deepstack):
                residual = residual + deepstack[i]
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3VLTextForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3VLTextModel


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_cls = Qwen3VisionTransformer

    text_cls = Qwen3VLTextForCausalLM

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.hidden_size = config.text_config.hidden_size
        self.num_deepstack = len(self.visual.deepstack_layers)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T, hidden * (1 + deepstack layers)]: the embeddings, then zeros."""
        embeds = self.language_model.model.embed(input_ids)
        return torch.cat([embeds, embeds.new_zeros(embeds.size(0),
                                                   self.hidden_size * self.num_deepstack)], -1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate=None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        deepstack = ()
        if inputs_embeds is not None:
            inputs_embeds, *deepstack = inputs_embeds.split(self.hidden_size, dim=-1)
        return self.language_model.model(input_ids, positions, intermediate, inputs_embeds,
                                         tuple(deepstack))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Qwen3-VL's names (`linear_fc1`, `linear_fc2`, the mergers' `norm`) as Qwen2-VL's."""
        return super().load_weights((qwen2_vl_name(name), t) for name, t in weights)


def qwen2_vl_name(name: str) -> str:
    name = name.replace(".linear_fc1.", ".fc1.").replace(".linear_fc2.", ".fc2.")
    if "merger" in name:
        return name.replace(".norm.", ".ln_q.")
    return name.replace("patch_embed.proj.bias", "patch_embed.bias")
