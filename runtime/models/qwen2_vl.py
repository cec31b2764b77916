"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`): a ViT over 14-pixel patches of two frames (the
temporal patch), rotated by each patch's (row, column) in its image, whose 2x2 neighbours
the patch merger folds into one embedding per image token; and a Qwen2 language model whose
rotary embedding is M-RoPE (t, h, w positions per token, `runtime.multimodal.mrope`).

Qwen2.5-VL's ViT uses RMSNorm and a gated MLP, and attends within windows of
`window_size` pixels except in its `fullatt_block_indexes` layers: the patches are put in
window order (whole merge units at a time) for the layers and back after the merger.

An image may take any number of tokens (`image_grid_thw`, from the model's own image
processor); images only (no video), one rank. Checkpoints load with either naming
(`visual.*` and `model.layers.*`, or transformers 5's `model.visual.*` and
`model.language_model.*`).
"""
from __future__ import annotations

import copy
from typing import Iterable

import numpy as np
import torch
from torch import nn

from runtime.attention_backends.base import prefill_only_metadata
from runtime.forward_context import forward_context
from runtime.layers.activation import SiluAndMul
from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from runtime.layers.rotary import (AxialRotary, MRotaryOp, _base_inv_freq, mrope_axes,
                                   rope_parameters)
from runtime.models.clip import vision_activation
from runtime.models.llama import default_weight_loader
from runtime.models.qwen import Qwen2Attention, Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2Model
from runtime.models.vlm import VisionLanguageModel


def patch_rows_cols(grids: list[list[int]], merge: int) -> np.ndarray:
    """[2, N]: each patch's row and column in its image, in merge-unit order (the image
    processor's: the merge x merge patches of each unit together)."""
    out = []
    for t, h, w in grids:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        unit_order = [a.reshape(shape).transpose(0, 2, 1, 3).reshape(-1) for a in (rows, cols)]
        out.append(np.tile(np.stack(unit_order), (1, t)))
    return np.concatenate(out, axis=1)


def frames(grids: list[list[int]], device: torch.device):
    """The metadata of attention within each frame of each image."""
    return prefill_only_metadata([h * w for t, h, w in grids for _ in range(t)], False, device)


def vision_rotary(head_size: int, theta: float, ctx: BuildContext) -> AxialRotary:
    """The Qwen-VL ViT's 2-D rotary: the same frequencies 1/theta^(4i/d) for the row half and
    the column half of each head."""
    return AxialRotary(head_size, _base_inv_freq(theta, head_size // 2).repeat(2),
                       ctx.custom_op("rotary_embedding"))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int, rotary: AxialRotary, ctx: BuildContext) -> None:
        super().__init__()
        head_size = dim // heads
        self.qkv = ReplicatedLinear(dim, 3 * dim, True, ctx)
        self.proj = ReplicatedLinear(dim, dim, True, ctx)
        self.attn = Attention(heads, head_size, head_size ** -0.5, heads, ctx, encoder=True)
        self.rotary = [rotary]  # shared, not a submodule

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = self.rotary[0](table, q, k)
        return self.proj(self.attn(q, k, v))


class VisionMlp(nn.Module):
    """fc1, activation, fc2 (Qwen2-VL's and Qwen3-VL's)."""

    def __init__(self, dim: int, hidden: int, act: str, ctx: BuildContext) -> None:
        super().__init__()
        self.fc1 = ReplicatedLinear(dim, hidden, True, ctx)
        self.fc2 = ReplicatedLinear(hidden, dim, True, ctx)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMlp(nn.Module):
    """Qwen2.5-VL: down(silu(gate(x)) * up(x)), with biases."""

    def __init__(self, config, dim: int, ctx: BuildContext) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen2.5-VL vision activation {config.hidden_act!r} is not "
                             "supported; supported: silu")
        self.gate_up_proj = MergedColumnParallelLinear(dim, [config.intermediate_size] * 2,
                                                       True, ctx)
        self.down_proj = ReplicatedLinear(config.intermediate_size, dim, True, ctx)
        self.act = SiluAndMul(ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def layer_norm(dim: int, rms: bool, ctx: BuildContext) -> nn.Module:
    return RMSNorm(dim, 1e-6, ctx) if rms else nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: nn.Module, rotary: AxialRotary,
                 ctx: BuildContext, rms: bool) -> None:
        super().__init__()
        self.norm1 = layer_norm(dim, rms, ctx)
        self.norm2 = layer_norm(dim, rms, ctx)
        self.attn = VisionAttention(dim, heads, rotary, ctx)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), table)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge unit's patches side by side, through norm, fc1, GELU and fc2; the norm is
    over each patch, or with `postshuffle` (Qwen3-VL's deepstack mergers) over the unit."""

    def __init__(self, out_dim: int, dim: int, merge: int, ctx: BuildContext, rms: bool,
                 postshuffle: bool = False) -> None:
        super().__init__()
        self.width = dim * merge ** 2
        self.postshuffle = postshuffle
        self.ln_q = layer_norm(self.width if postshuffle else dim, rms, ctx)
        self.fc1 = ReplicatedLinear(self.width, self.width, True, ctx)
        self.fc2 = ReplicatedLinear(self.width, out_dim, True, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x.view(-1, self.width) if self.postshuffle else x).view(-1, self.width)
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Qwen2VisionTransformer(nn.Module):
    """Patches [N, channels * temporal_patch * patch * patch] of images of grids (t, h, w),
    in the image processor's order (each merge unit's patches together) -> one embedding
    per merge unit [N / merge**2, out hidden]."""

    v2_5 = False

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        dim = config.hidden_size if self.v2_5 else config.embed_dim
        out_dim = config.out_hidden_size if self.v2_5 else config.hidden_size
        self.merge = config.spatial_merge_size
        patch = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.patch_embed = ReplicatedLinear(patch, dim, False, ctx)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary = vision_rotary(dim // config.num_heads, theta, ctx)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, config.num_heads, VisionGatedMlp(config, dim, ctx) if self.v2_5
                        else VisionMlp(dim, int(dim * config.mlp_ratio), config.hidden_act, ctx),
                        self.rotary, ctx, self.v2_5)
            for _ in range(config.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, ctx, self.v2_5)
        self.to(ctx.dtype)  # torch.nn layers are made in float32

    def forward(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        table = self.rotary.table(torch.from_numpy(patch_rows_cols(grids, self.merge)).to(
            x.device))
        with forward_context(frames(grids, x.device)):
            for block in self.blocks:
                x = block(x, table)
        return self.merger(x)


class Qwen2_5VisionTransformer(Qwen2VisionTransformer):
    v2_5 = True

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.window = config.window_size // self.merge // config.patch_size  # merge units
        self.full_layers = set(config.fullatt_block_indexes)

    def windows(self, grids: list[list[int]]) -> tuple[np.ndarray, list[int]]:
        """The merge units in window order (windows of `window` x `window` units, row by row,
        in each frame), and the patches each window holds."""
        order, lens, first = [], [], 0
        for t, h, w in grids:
            gh, gw, s = h // self.merge, w // self.merge, self.window
            units = np.arange(t * gh * gw).reshape(t, gh, gw) + first
            for frame in units:
                for r in range(0, gh, s):
                    for c in range(0, gw, s):
                        block = frame[r:r + s, c:c + s].reshape(-1)
                        order.append(block)
                        lens.append(block.size * self.merge ** 2)
            first += t * gh * gw
        return np.concatenate(order), lens

    def forward(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        table = self.rotary.table(torch.from_numpy(patch_rows_cols(grids, self.merge)).to(x.device))
        order, lens = self.windows(grids)
        unit = torch.from_numpy(order).to(x.device)
        n = unit.numel()
        x = x.view(n, -1, x.size(-1))[unit].reshape(x.shape)
        table = table.view(n, -1, table.size(-1))[unit].reshape(table.shape)
        full = frames(grids, x.device)
        windows = prefill_only_metadata(lens, False, x.device)
        for i, block in enumerate(self.blocks):
            with forward_context(full if i in self.full_layers else windows):
                x = block(x, table)
        return self.merger(x)[torch.argsort(unit)]


def mrope_op(attention: nn.Module, config, default_section: list[int],
             interleaved: bool = False) -> MRotaryOp:
    """An attention layer's rotary op, as M-RoPE over the config's `mrope_section`."""
    params = rope_parameters(config)
    if params["rope_type"] != "default":
        raise ValueError(f"M-RoPE with rope_type {params['rope_type']!r} is not supported; "
                         "supported: default")
    return MRotaryOp(attention.rotary_op, mrope_axes(
        attention.rotary_emb.rotary_dim, params.get("mrope_section", default_section),
        interleaved))


class Qwen2VLAttention(Qwen2Attention):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__(config, layer_idx, ctx, prefix)
        self.rotary_op = mrope_op(self, config, [16, 24, 24])


class Qwen2VLDecoderLayer(Qwen2DecoderLayer):
    attention_cls = Qwen2VLAttention


class Qwen2VLTextModel(Qwen2Model):
    layer_cls = Qwen2VLDecoderLayer


class Qwen2VLTextForCausalLM(Qwen2ForCausalLM):
    model_cls = Qwen2VLTextModel


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    vision_cls = Qwen2VisionTransformer
    text_cls = Qwen2VLTextForCausalLM

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        if ctx.tp_size > 1 or ctx.pp.size > 1:
            raise ValueError(f"{type(self).__name__} runs on one rank: tensor and pipeline "
                             "parallel size 1")
        self.config = config
        self.visual = self.vision_cls(config.vision_config, ctx)
        text = copy.copy(config.text_config)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.language_model = self.text_cls(text, ctx)

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's embeddings [t * h * w / merge**2, text hidden]."""
        grids = [item["image_grid_thw"].tolist() for item in items]
        out = self.visual(torch.cat([item["pixel_values"] for item in items]), grids)
        merge = self.visual.merge ** 2
        return list(out.split([t * h * w // merge for t, h, w in grids]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.visual.named_parameters())
        text: list[tuple[str, torch.Tensor]] = []
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith(("model.visual.", "model.language_model.")):
                name = name.removeprefix("model.")
            if name.startswith("language_model."):
                text.append(("model." + name.removeprefix("language_model."), tensor))
                continue
            if not name.startswith("visual."):
                text.append((name, tensor))  # model.* and lm_head.*
                continue
            name = name.removeprefix("visual.")
            if name == "patch_embed.proj.weight":  # a Conv3d with stride = kernel: a matmul
                name, tensor = "patch_embed.weight", tensor.reshape(tensor.size(0), -1)
            name = name.replace("merger.mlp.0.", "merger.fc1.").replace("merger.mlp.2.",
                                                                        "merger.fc2.")
            for part, shard in ((".gate_proj.", 0), (".up_proj.", 1)):
                if part in name:
                    name = name.replace(part, ".gate_up_proj.")
                    params[name].weight_loader(params[name], tensor, shard)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor 'visual.{name}' has no place in "
                                     f"{type(self).__name__}")
                default_weight_loader(params[name], tensor)
            loaded.add(f"visual.{name}")
        return loaded | {f"language_model.{n}" for n in self.language_model.load_weights(text)}


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_cls = Qwen2_5VisionTransformer
