"""Qwen3.5 and Qwen3.5-MoE with their vision tower (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`): Qwen3-VL's ViT (learned position table resampled to
each image's grid, 2-D rotary, patch merger; no DeepStack) and the hybrid Qwen3.5 language
model (gated delta-nets beside gated attention), whose attention rotates the rotary part of
each head by interleaved M-RoPE (`runtime.multimodal.mrope`, as Qwen3-VL's).

The gated delta-nets take no positions, so an image's tokens reach them as any token's
embedding; their state is the recurrent state cache's (chunked prefill, prefix-cache
checkpoints and preemption as for the text model). Images only (no video), one rank.
"""
from __future__ import annotations

from typing import Iterable

import torch

from runtime.layers.build_context import BuildContext
from runtime.models.qwen2_vl import Qwen2VLForConditionalGeneration, mrope_op
from runtime.models.qwen3_5 import (Qwen3_5Attention, Qwen3_5DecoderLayer, Qwen3_5ForCausalLM,
                                    Qwen3_5Model, Qwen3_5MoeDecoderLayer, Qwen3_5MoeForCausalLM,
                                    Qwen3_5MoeModel)
from runtime.models.qwen3_vl import Qwen3VisionTransformer, qwen2_vl_name


class Qwen3_5VLAttention(Qwen3_5Attention):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__(config, layer_idx, ctx, prefix)
        # transformers' Qwen3.5 rotary always interleaves, whatever mrope_interleaved says
        self.rotary_op = mrope_op(self, config, [11, 11, 10], interleaved=True)


class Qwen3_5VLDecoderLayer(Qwen3_5DecoderLayer):
    attention_cls = Qwen3_5VLAttention


class Qwen3_5VLTextModel(Qwen3_5Model):
    layer_cls = Qwen3_5VLDecoderLayer


class Qwen3_5VLTextForCausalLM(Qwen3_5ForCausalLM):
    model_cls = Qwen3_5VLTextModel


class Qwen3_5MoeVLDecoderLayer(Qwen3_5MoeDecoderLayer):
    attention_cls = Qwen3_5VLAttention


class Qwen3_5MoeVLTextModel(Qwen3_5MoeModel):
    layer_cls = Qwen3_5MoeVLDecoderLayer


class Qwen3_5MoeVLTextForCausalLM(Qwen3_5MoeForCausalLM):
    model_cls = Qwen3_5MoeVLTextModel


class Qwen3_5ForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_cls = Qwen3VisionTransformer
    text_cls = Qwen3_5VLTextForCausalLM
    is_hybrid = True

    def __init__(self, config, ctx: BuildContext) -> None:
        if getattr(config.vision_config, "deepstack_visual_indexes", None):
            raise ValueError(f"{type(self).__name__} with deepstack_visual_indexes is not "
                             "supported: Qwen3.5's language model takes no DeepStack features")
        super().__init__(config, ctx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Qwen3-VL's vision names, as Qwen2-VL's; the multi-token-prediction head (`mtp.*`,
        a speculative decoder the released checkpoints carry) is skipped, as transformers
        skips it."""
        return super().load_weights((qwen2_vl_name(name), t) for name, t in weights
                                    if not name.startswith("mtp."))


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    text_cls = Qwen3_5MoeVLTextForCausalLM
