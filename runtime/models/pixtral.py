"""The Pixtral vision encoder (Mistral 3's) on our layers: each image at its own size, its
patches embedded by one matmul (the checkpoint's stride = kernel Conv2d), RMSNorm, then pre-norm
layers whose attention is bidirectional within each image (the platform's prefill-only mode, one
sequence per image) with q and k rotated by the patch's row and column (2-D rotary), and a
gated MLP. Module names follow the checkpoints (`patch_conv`, `ln_pre`,
`transformer.layers.{i}.attention.*`, `feed_forward.*`); q, k and v load into one `qkv_proj`,
gate and up into one `gate_up_proj`.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.attention_backends.base import prefill_only_metadata
from runtime.forward_context import forward_context
from runtime.layers.activation import SiluAndMul
from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from runtime.layers.rotary import AxialRotary
from runtime.models.clip import vision_activation

NORM_EPS = 1e-5  # Pixtral's, whatever the config says


def pixtral_rotary(config, ctx: BuildContext) -> AxialRotary:
    """Axial 2-D rotary over the whole head: of the head's frequencies 1/theta^(2i/d), the even
    ones turn with the patch's row and the odd ones with its column."""
    params = config.rope_parameters or {}
    if params.get("rope_type", "axial") != "axial":
        raise ValueError(f"Pixtral rope_type {params['rope_type']!r} is not supported; "
                         "supported: axial")
    head_size = config.hidden_size // config.num_attention_heads
    theta = params.get("rope_theta", 10000.0)
    freqs = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    return AxialRotary(head_size, torch.cat([freqs[0::2], freqs[1::2]]),
                       ctx.custom_op("rotary_embedding"))


class PixtralAttention(nn.Module):
    def __init__(self, config, rotary: AxialRotary, ctx: BuildContext) -> None:
        super().__init__()
        heads, dim = config.num_attention_heads, config.hidden_size
        head_size = dim // heads
        self.qkv_proj = QKVParallelLinear(dim, head_size, heads, heads, False, ctx)
        self.o_proj = ReplicatedLinear(dim, dim, False, ctx)
        self.attn = Attention(heads, head_size, head_size ** -0.5, heads, ctx, encoder=True)
        self.rotary = [rotary]  # shared, not a submodule

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q, k = self.rotary[0](table, q, k)
        return self.o_proj(self.attn(q, k, v))


class PixtralMLP(nn.Module):
    """down(act(gate(x)) * up(x)), no biases."""

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        hidden = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [hidden] * 2, False,
                                                       ctx)
        self.down_proj = ReplicatedLinear(hidden, config.hidden_size, False, ctx)
        if config.hidden_act == "silu":
            self.act = SiluAndMul(ctx)
        else:
            act = vision_activation(config.hidden_act)
            self.act = lambda x: act(x[..., :hidden]) * x[..., hidden:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class PixtralLayer(nn.Module):
    def __init__(self, config, rotary: AxialRotary, ctx: BuildContext) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, NORM_EPS, ctx)
        self.attention = PixtralAttention(config, rotary, ctx)
        self.ffn_norm = RMSNorm(config.hidden_size, NORM_EPS, ctx)
        self.feed_forward = PixtralMLP(config, ctx)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), table)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, config, rotary: AxialRotary, ctx: BuildContext, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralLayer(config, rotary, ctx) for _ in range(num_layers))


class PixtralVisionModel(nn.Module):
    """Images [C, H, W] of (height, width) sizes (multiples of the patch) -> the hidden states
    [patches of all images, hidden] after `num_layers` layers (0: after `ln_pre`), each
    image's patches row by row. Only the layers a caller reads are built."""

    def __init__(self, config, ctx: BuildContext, num_layers: int) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.patch_conv = ReplicatedLinear(config.num_channels * config.patch_size ** 2,
                                           config.hidden_size, False, ctx)
        self.ln_pre = RMSNorm(config.hidden_size, NORM_EPS, ctx)
        self.rotary = pixtral_rotary(config, ctx)
        self.transformer = PixtralTransformer(config, self.rotary, ctx, num_layers)

    def patches(self, pixels: torch.Tensor, size: list[int]) -> torch.Tensor:
        """[C, H, W] -> [h * w, C * patch * patch] of the image's (height, width) `size`, in the
        Conv2d weight's (channel, row, column) order."""
        p = self.patch_size
        h, w = size[0] // p, size[1] // p
        x = pixels[:, :h * p, :w * p].reshape(pixels.size(0), h, p, w, p)
        return x.permute(1, 3, 0, 2, 4).reshape(h * w, -1)

    def forward(self, pixels: list[torch.Tensor], sizes: list[list[int]]) -> torch.Tensor:
        dtype = self.patch_conv.weight.dtype
        x = self.patch_conv(torch.cat([self.patches(px.to(dtype), s)
                                       for px, s in zip(pixels, sizes)]))
        x = self.ln_pre(x)
        grids = [(h // self.patch_size, w // self.patch_size) for h, w in sizes]
        rows_cols = torch.cat([torch.stack(torch.meshgrid(
            torch.arange(h), torch.arange(w), indexing="ij")).reshape(2, -1)
            for h, w in grids], dim=1).to(x.device)
        table = self.rotary.table(rows_cols)
        with forward_context(prefill_only_metadata([h * w for h, w in grids], False, x.device)):
            for layer in self.transformer.layers:
                x = layer(x, table)
        return x
