"""The SigLIP vision tower (Gemma 3's encoder) on our layers: patch embeddings plus a learned
position per patch (no class token, no norm before the layers), CLIP's pre-norm transformer
layers with bidirectional attention in the platform's prefill-only mode, one image per
sequence, and a final LayerNorm. Module names follow the Hugging Face checkpoints
(`embeddings.*`, `encoder.layers.{i}.*`, `post_layernorm`); the pooling head, which Gemma 3
does not read, is not built.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.attention_backends.base import prefill_only_metadata
from runtime.forward_context import forward_context
from runtime.layers.build_context import BuildContext
from runtime.models.clip import CLIPEncoder


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size,
                                         config.patch_size, config.patch_size)
        num_positions = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, patches, hidden], patches in row-major order."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """`embeddings`: a module of [B, C, H, W] -> [B, patches, hidden] in place of SigLIP's
    (Idefics3's positions for tiles of any size)."""

    def __init__(self, config, ctx: BuildContext, embeddings: nn.Module | None = None) -> None:
        super().__init__()
        self.embeddings = embeddings or SiglipVisionEmbeddings(config)
        self.encoder = CLIPEncoder(config, ctx, config.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.to(ctx.dtype)  # torch.nn layers are made in float32

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] of the tower's image size -> the last hidden states [B, patches,
        hidden], normalised."""
        x = self.embeddings(pixel_values)
        b, n, d = x.shape
        with forward_context(prefill_only_metadata([n] * b, False, x.device)):
            flat = x.reshape(b * n, d)
            for layer in self.encoder.layers:
                flat = layer(flat)
        return self.post_layernorm(flat.view(b, n, d))
