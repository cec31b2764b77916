"""The CLIP vision tower (LLaVA's encoder) on our layers: patch and position embeddings, then
pre-norm transformer layers whose bidirectional attention runs in the platform's prefill-only
mode, one image per sequence. Module names follow the Hugging Face checkpoints
(`embeddings.*`, `pre_layrnorm`, `encoder.layers.{i}.*`); q, k and v load into one `qkv_proj`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.attention_backends.base import prefill_only_metadata
from runtime.forward_context import forward_context
from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.linear import QKVParallelLinear, ReplicatedLinear

VISION_ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
                      "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def vision_activation(name: str):
    if name not in VISION_ACTIVATIONS:
        raise ValueError(f"vision activation {name!r} is not supported; supported: "
                         f"{', '.join(VISION_ACTIVATIONS)}")
    return VISION_ACTIVATIONS[name]


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size,
                                         config.patch_size, config.patch_size, bias=False)
        num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, 1 + patches, hidden] (the class token first)."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.size(0), 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        heads = config.num_attention_heads
        head_size = config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_size, heads, heads, True, ctx)
        self.out_proj = ReplicatedLinear(config.hidden_size, config.hidden_size, True, ctx)
        self.attn = Attention(heads, head_size, head_size ** -0.5, heads, ctx, encoder=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.attn(*self.qkv_proj(x).chunk(3, dim=-1)))


class CLIPMLP(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.fc1 = ReplicatedLinear(config.hidden_size, config.intermediate_size, True, ctx)
        self.fc2 = ReplicatedLinear(config.intermediate_size, config.hidden_size, True, ctx)
        self.act = vision_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = CLIPAttention(config, ctx)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config, ctx: BuildContext, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config, ctx) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """Images to the hidden states of the layers asked for. `num_layers`: only the layers up to
    the deepest one a caller reads are built (LLaVA reads the second to last)."""

    def __init__(self, config, ctx: BuildContext, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config, ctx, num_layers)
        self.to(ctx.dtype)  # torch.nn layers are made in float32

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """[B, C, H, W] -> for each index in `layers` (0: the embeddings, i: after layer i),
        the hidden states [B, 1 + patches, hidden]."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        b, n, d = x.shape
        states = [x]
        with forward_context(prefill_only_metadata([n] * b, False, x.device)):
            flat = x.reshape(b * n, d)
            for layer in self.encoder.layers:
                flat = layer(flat)
                states.append(flat.view(b, n, d))
        return [states[i] for i in layers]
