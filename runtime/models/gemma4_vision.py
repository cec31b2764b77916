"""The Gemma 4 vision encoder (`Gemma4VisionModel`) and its embedder into the text width, on
our layers. Each image comes at its own size as its patches (the image processor's
`pixel_values` rows, padding dropped) and their (x, y) places:

- a linear patch embedding of the pixels scaled to [-1, 1], plus a learned embedding of the
  patch's x and one of its y;
- pre- and post-normed layers (float32 `weight` RMSNorms) whose attention is bidirectional
  within each image (the platform's prefill-only mode, one sequence per image), with Q, K, V
  normalised per head (V without a weight), scale 1, and a 2-D rotary: the first half of
  each head turns with the patch's x, the second with its y, each half rotate-half;
- optionally clipped linears: each projection clamps its input and its output to the
  checkpoint's bounds;
- each k x k square of patches (`pooling_kernel_size`) averaged into one token, times
  sqrt(hidden), optionally standardized (`std_bias`, `std_scale`), all in float32;
- the embedder: an unweighted RMSNorm and a projection to the text hidden size.

Module names follow the checkpoints (`patch_embedder.*`, `encoder.layers.{i}.*`,
`*.linear.weight` and `*.input_min` … of a clipped linear).
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.attention_backends.base import prefill_only_metadata
from runtime.forward_context import forward_context
from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.linear import ReplicatedLinear
from runtime.models.clip import vision_activation
from runtime.models.gemma4 import Gemma4RMSNorm
from runtime.plugins.ops import rotary_embedding


def frozen(value: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(value, requires_grad=False)


class Gemma4ClippableLinear(nn.Module):
    """A bias-free linear whose input and output are clamped to the checkpoint's bounds when
    the config says `use_clipped_linears` (the bounds default to none)."""

    def __init__(self, config, in_size: int, out_size: int, ctx: BuildContext) -> None:
        super().__init__()
        self.linear = ReplicatedLinear(in_size, out_size, False, ctx)
        self.clipped = bool(config.use_clipped_linears)
        if self.clipped:
            inf = torch.tensor(float("inf"), dtype=ctx.dtype)
            self.input_min, self.output_min = frozen(-inf), frozen(-inf.clone())
            self.input_max, self.output_max = frozen(inf.clone()), frozen(inf.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = self.linear(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(x, self.output_min, self.output_max)


class Gemma4VisionRotary:
    """Each head's halves rotated (rotate-half, the platform's `rotary_embedding` op) by the
    patch's x and y, with the frequencies 1/theta^(4i/head_size) of `head_size // 4` pairs."""

    def __init__(self, config, op=None) -> None:
        params = config.rope_parameters or {}
        if params.get("rope_type", "axial") != "axial":
            raise ValueError(f"Gemma 4 vision rope_type {params['rope_type']!r} is not "
                             f"supported; supported: axial")
        self.half = config.head_dim // 2
        theta = params.get("rope_theta", 100.0)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.half, 2, dtype=torch.float32)
                                        / self.half)
        self.op = op or rotary_embedding

    def table(self, xy: torch.Tensor) -> torch.Tensor:
        """cos | sin [positions, head_size // 2] for positions up to the largest of `xy`."""
        angles = torch.arange(int(xy.max()) + 1, dtype=torch.float32)[:, None] * self.inv_freq
        return torch.cat((angles.cos(), angles.sin()), dim=-1).to(xy.device)

    def __call__(self, xy: torch.Tensor, table: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [N, heads * head_size] rotated in float32 by the patches' xy [N, 2]."""
        n, dtype = q.size(0), q.dtype
        qh, kh = q.float().view(n, -1, 2, self.half), k.float().view(n, -1, 2, self.half)
        parts = [self.op(xy[:, axis], qh[:, :, axis].reshape(n, -1),
                         kh[:, :, axis].reshape(n, -1), table, self.half) for axis in (0, 1)]
        q = torch.stack([p[0].view(n, -1, self.half) for p in parts], dim=2)
        k = torch.stack([p[1].view(n, -1, self.half) for p in parts], dim=2)
        return q.reshape(n, -1).to(dtype), k.reshape(n, -1).to(dtype)


class Gemma4VisionAttention(nn.Module):
    def __init__(self, config, rotary: Gemma4VisionRotary, ctx: BuildContext) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size, hidden, eps = config.head_dim, config.hidden_size, config.rms_norm_eps
        self.q_proj = Gemma4ClippableLinear(config, hidden, heads * self.head_size, ctx)
        self.k_proj = Gemma4ClippableLinear(config, hidden, kv_heads * self.head_size, ctx)
        self.v_proj = Gemma4ClippableLinear(config, hidden, kv_heads * self.head_size, ctx)
        self.o_proj = Gemma4ClippableLinear(config, heads * self.head_size, hidden, ctx)
        self.q_norm = Gemma4RMSNorm(self.head_size, eps, ctx)
        self.k_norm = Gemma4RMSNorm(self.head_size, eps, ctx)
        self.v_norm = Gemma4RMSNorm(self.head_size, eps, ctx, with_scale=False)
        self.attn = Attention(heads, self.head_size, 1.0, kv_heads, ctx, encoder=True)
        self.rotary = rotary

    def _heads(self, x: torch.Tensor, norm: Gemma4RMSNorm) -> torch.Tensor:
        return norm(x.view(x.size(0), -1, self.head_size)).view(x.size(0), -1)

    def forward(self, x: torch.Tensor, xy: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        q, k = self._heads(self.q_proj(x), self.q_norm), self._heads(self.k_proj(x), self.k_norm)
        v = self._heads(self.v_proj(x), self.v_norm)
        q, k = self.rotary(xy, table, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma4VisionMLP(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = Gemma4ClippableLinear(config, hidden, inner, ctx)
        self.up_proj = Gemma4ClippableLinear(config, hidden, inner, ctx)
        self.down_proj = Gemma4ClippableLinear(config, inner, hidden, ctx)
        self.act = vision_activation(config.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma4VisionEncoderLayer(nn.Module):
    def __init__(self, config, rotary: Gemma4VisionRotary, ctx: BuildContext) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4VisionAttention(config, rotary, ctx)
        self.mlp = Gemma4VisionMLP(config, ctx)
        self.input_layernorm = Gemma4RMSNorm(size, eps, ctx)
        self.post_attention_layernorm = Gemma4RMSNorm(size, eps, ctx)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(size, eps, ctx)
        self.post_feedforward_layernorm = Gemma4RMSNorm(size, eps, ctx)

    def forward(self, x: torch.Tensor, xy: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), xy, table))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4VisionEncoder(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.rotary = Gemma4VisionRotary(config, ctx.custom_op("rotary_embedding"))
        self.layers = nn.ModuleList(Gemma4VisionEncoderLayer(config, self.rotary, ctx)
                                    for _ in range(config.num_hidden_layers))


class Gemma4VisionPatchEmbedder(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.input_proj = ReplicatedLinear(3 * config.patch_size ** 2, config.hidden_size,
                                           False, ctx)
        self.position_embedding_table = frozen(torch.zeros(
            2, config.position_embedding_size, config.hidden_size, dtype=ctx.dtype))

    def forward(self, patches: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
        x = self.input_proj((2 * (patches - 0.5)).to(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        return x + table[0][xy[:, 0]] + table[1][xy[:, 1]]


class Gemma4VisionModel(nn.Module):
    """Images as patches [N_i, 3 * patch^2] at xy [N_i, 2] -> their pooled, scaled (and
    standardized) tokens [N_i / k^2, hidden] each, row by row of the pooled grid."""

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        if config.position_embedding_size <= 0:
            raise ValueError("Gemma 4 vision needs a position_embedding_size")
        self.kernel = config.pooling_kernel_size
        self.root_hidden = config.hidden_size ** 0.5
        self.patch_embedder = Gemma4VisionPatchEmbedder(config, ctx)
        self.encoder = Gemma4VisionEncoder(config, ctx)
        self.standardize = bool(config.standardize)
        if self.standardize:
            self.std_bias = frozen(torch.zeros(config.hidden_size, dtype=ctx.dtype))
            self.std_scale = frozen(torch.ones(config.hidden_size, dtype=ctx.dtype))

    def pool(self, x: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
        """The mean of each k x k square of one image's patches [N, hidden], in float32, the
        squares row by row."""
        k = self.kernel
        if xy.size(0) % (k * k):
            raise ValueError(f"a Gemma 4 image of {xy.size(0)} patches does not pool in "
                             f"{k}x{k} squares")
        width = int(xy[:, 0].max()) // k + 1
        square = xy[:, 0] // k + width * (xy[:, 1] // k)
        out = torch.zeros(xy.size(0) // (k * k), x.size(1), dtype=torch.float32,
                          device=x.device)
        return out.index_add_(0, square, x.float()) / (k * k)

    def forward(self, patches: list[torch.Tensor], xys: list[torch.Tensor]
                ) -> list[torch.Tensor]:
        xy = torch.cat(xys)
        x = self.patch_embedder(torch.cat(patches), xy)
        table = self.encoder.rotary.table(xy)
        lens = [p.size(0) for p in patches]
        with forward_context(prefill_only_metadata(lens, False, x.device)):
            for layer in self.encoder.layers:
                x = layer(x, xy, table)
        out = []
        for hidden, image_xy in zip(x.split(lens), xys):
            pooled = self.pool(hidden, image_xy) * self.root_hidden
            if self.standardize:
                pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
            out.append(pooled.to(x.dtype))
        return out


class Gemma4MultimodalEmbedder(nn.Module):
    """Vision tokens into the text width: an unweighted RMSNorm, then a projection."""

    def __init__(self, vision_config, text_config, ctx: BuildContext) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = Gemma4RMSNorm(
            vision_config.hidden_size, vision_config.rms_norm_eps, ctx, with_scale=False)
        self.embedding_projection = ReplicatedLinear(vision_config.hidden_size,
                                                     text_config.hidden_size, False, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))
