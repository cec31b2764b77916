"""Idefics3 (`Idefics3ForConditionalGeneration`) and SmolVLM (`SmolVLMForConditionalGeneration`):
a SigLIP-style vision transformer over each tile of an image, a connector that pixel-shuffles
`scale_factor` x `scale_factor` patches into one token and projects it, and a Llama language
model.

An image item is all its tiles (the split tiles, then the global image) and covers its whole
placeholder run, from its first `<fake_token_around_image>` to its last: the rows of the run's
text tokens (`<row_r_col_c>`, `<global-img>`, newlines) are those tokens' own embeddings, the
`<image>` rows the tiles' features in order, as transformers merges them. So the encoder
cache, the encoder budget and chunked prefill see one run per image, of its real length.
Checkpoint names: `model.vision_model.*`, `model.connector.*`, `model.text_model.*`,
`lm_head.*`. One rank.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.linear import ReplicatedLinear
from runtime.models.llama import LlamaForCausalLM
from runtime.models.siglip import SiglipVisionTower
from runtime.models.vlm import VisionLanguageModel



def patch_position_ids(rows: int, cols: int, side: int) -> torch.Tensor:
    """The position-table index of each patch of a `rows` x `cols` grid: the grid's fractional
    coordinates bucketed into the `side` x `side` table (NaViT's variable-resolution rule),
    in transformers' float32 arithmetic, so a coordinate on a bucket's edge falls the same."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)

    def buckets(n: int) -> torch.Tensor:
        coords = torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor(n))
        return torch.bucketize(torch.clamp(coords, max=1 - 1e-6), boundaries, right=True)

    return (buckets(rows)[:, None] * side + buckets(cols)[None, :]).flatten()


class Idefics3VisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.side = config.image_size // config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size,
                                         config.patch_size, config.patch_size)
        self.position_embedding = nn.Embedding(self.side ** 2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] tiles (no padded patch) -> [N, patches, hidden]."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        rows, cols = patches.shape[-2:]
        positions = patch_position_ids(rows, cols, self.side).to(patches.device)
        return patches.flatten(2).transpose(1, 2) + self.position_embedding(positions)


class Idefics3Connector(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.scale_factor = config.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = ReplicatedLinear(
            config.vision_config.hidden_size * config.scale_factor ** 2,
            config.text_config.hidden_size, False, ctx)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """[N, side * side, d] -> [N, (side / s) ** 2, d * s * s]: each s x s block of patches
        (row-major within the block) becomes one token."""
        n, seq, d = x.shape
        side, s = int(seq ** 0.5), self.scale_factor
        x = x.view(n, side // s, s, side // s, s, d).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(n, seq // s ** 2, d * s * s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(self.pixel_shuffle(x))


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    supports_prompt_embeds = True  # a prompt of embeddings carries no image

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        vision = config.vision_config
        if ctx.tp_size > 1 or ctx.pp.size > 1:
            raise ValueError(f"{type(self).__name__} runs on one rank: tensor and pipeline "
                             "parallel size 1")
        if config.text_config.model_type != "llama":
            raise ValueError(f"{type(self).__name__} with a {config.text_config.model_type!r} "
                             "language model is not supported; supported: llama")
        side = vision.image_size // vision.patch_size
        if side % config.scale_factor:
            raise ValueError(f"scale_factor {config.scale_factor} does not divide the "
                             f"{side} x {side} patch grid")
        self.config = config
        self.image_token_id = config.image_token_id
        # SigLIP's layers over tiles, each attending within itself
        self.vision_model = SiglipVisionTower(vision, ctx, Idefics3VisionEmbeddings(vision))
        self.connector = Idefics3Connector(config, ctx)
        text = copy.copy(config.text_config)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.language_model = LlamaForCausalLM(text, ctx)

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's run of embeddings [run length, text hidden]: its `input_ids` (the
        placeholder run) embedded, the `<image>` rows replaced by its tiles' features."""
        features = self.connector(self.vision_model(
            torch.cat([item["pixel_values"] for item in items])))
        out = []
        for item, tiles in zip(items, features.split([len(i["pixel_values"]) for i in items])):
            ids = item["input_ids"]
            embeds = self.embed_input_ids(ids)
            embeds[ids == self.image_token_id] = tiles.reshape(-1, tiles.size(-1)).to(
                embeds.dtype)
            out.append(embeds)
        return out

    vision_prefix = "vision_model."

    def text_weight_name(self, name: str) -> str | None:
        if name.startswith(("text_model.", "lm_head.")):
            return name.replace("text_model.", "model.", 1)
        return None


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """The same model: SmolVLM's checkpoints differ only in the sizes and the processor's."""
