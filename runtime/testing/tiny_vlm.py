"""Tiny random-weight vision-language models, saved as Hugging Face folders with their image
processor and a word-level tokenizer that knows the image placeholder, and test images.

Head dims are 32 and `initializer_range` 0.2 (see tiny_model.py), so greedy parity with
transformers is not a coin toss. Nothing is downloaded.
"""
from __future__ import annotations

import numpy as np
import torch

from runtime.testing.tiny_model import TINY_LLAMA, VOCAB_SIZE

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 3
# each message's content, then a space: the conversation as the words the tokenizer knows
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def save_vlm_tokenizer(path: str) -> None:
    """Word-level: <unk> <s> </s> <image>, then made-up words "w4" … up to VOCAB_SIZE."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, IMAGE_TOKEN: IMAGE_TOKEN_ID}
    vocab.update({f"w{i}": i for i in range(4, VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<unk>",
                            extra_special_tokens={"image_token": IMAGE_TOKEN},
                            chat_template=CHAT_TEMPLATE).save_pretrained(path)


def build_tiny_llava(path: str, seed: int = 0) -> str:
    """A LlavaForConditionalGeneration: CLIP tower (32x32 images, 8x8 patches: 16 image
    tokens), Llama language model, CLIP image processor (PIL backend)."""
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig,
                              LlavaConfig, LlavaForConditionalGeneration)
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, image_size=32, patch_size=8,
                              projection_dim=64, initializer_range=0.2)
    text = LlamaConfig(**{**TINY_LLAMA, "num_attention_heads": 2, "num_key_value_heads": 1})
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
                         initializer_range=0.2)
    LlavaForConditionalGeneration(config).eval().save_pretrained(path)
    save_vlm_tokenizer(path)
    CLIPImageProcessorPil(size={"shortest_edge": 32},
                          crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def random_image(seed: int, size: tuple[int, int] = (48, 40)):
    """A random RGB PIL image of `size` (width, height)."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
