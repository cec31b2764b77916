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


QWEN_VL_TOKENS = {"<|image_pad|>": 3, "<|vision_start|>": 4, "<|vision_end|>": 5,
                  "<|video_pad|>": 6}
QWEN_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # an image in a Qwen-VL prompt


def save_qwen_vl_tokenizer(path: str) -> None:
    """Word-level, with Qwen-VL's vision tokens as special tokens (so that a run of
    `<|image_pad|>` with no spaces between splits), then made-up words "w7" …"""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **QWEN_VL_TOKENS}
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in QWEN_VL_TOKENS])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<unk>",
                            extra_special_tokens={"image_token": "<|image_pad|>",
                                                  "video_token": "<|video_pad|>"},
                            chat_template=CHAT_TEMPLATE).save_pretrained(path)


def build_tiny_qwen_vl(path: str, version: str = "2", seed: int = 0) -> str:
    """A Qwen2VLForConditionalGeneration (`version` "2") or Qwen2_5_VLForConditionalGeneration
    ("2.5": RMSNorm, gated MLP, window attention in layer 0, full in layer 1) or
    Qwen3VLForConditionalGeneration ("3": 16-pixel patches, a 4x4 learned position table,
    DeepStack from layer 0, interleaved M-RoPE, Qwen3 text): patches merged 2x2, so a 56x56
    image gives 4 image tokens and a 112x84 one 12; M-RoPE sections (4, 6, 6), Qwen3-VL's
    (6, 5, 5), over 32-dim heads; the Qwen2-VL image processor (PIL backend)."""
    from transformers import Qwen2VLImageProcessorPil
    torch.manual_seed(seed)
    text = dict(TINY_LLAMA, num_attention_heads=2, num_key_value_heads=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [4, 6, 6]})
    ids = {"image_token_id": 3, "vision_start_token_id": 4, "vision_end_token_id": 5,
           "video_token_id": 6}
    if version == "2":
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLForConditionalGeneration as Model
        vision = dict(depth=2, embed_dim=64, hidden_size=64, num_heads=2, mlp_ratio=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    elif version == "2.5":
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model
        vision = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=2,
                      out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    elif version == "3":
        from transformers import Qwen3VLConfig as Config
        from transformers import Qwen3VLForConditionalGeneration as Model
        text["head_dim"] = 32
        text["rope_parameters"].update(mrope_section=[6, 5, 5], mrope_interleaved=True)
        vision = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=2,
                      out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2, num_position_embeddings=16,
                      deepstack_visual_indexes=[0])
    else:
        raise ValueError(f"Qwen-VL version {version!r}: '2', '2.5' or '3'")
    config = Config(text_config=text, vision_config={**vision, "initializer_range": 0.2},
                    initializer_range=0.2, **ids)
    Model(config).eval().save_pretrained(path)
    save_qwen_vl_tokenizer(path)
    Qwen2VLImageProcessorPil(patch_size=vision["patch_size"], merge_size=2,
                             temporal_patch_size=2).save_pretrained(path)
    return path


IDEFICS3_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                   "\n"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
IDEFICS3_IMAGE_TOKEN_ID = 3
# Idefics3's template: a message's content is a list of parts, an image part prints <image>
IDEFICS3_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %} {{ part['text'] }}{% endif %}"
    "{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}w50:{% endif %}")


def save_idefics3_tokenizer(path: str) -> None:
    """Word-level, with Idefics3's image tokens (`<image>`, `<fake_token_around_image>`,
    `<global-img>`, `<row_r_col_c>`) and "\\n" as added tokens, then made-up words "w44" …"""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({t: 3 + i for i, t in enumerate(IDEFICS3_TOKENS)})
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=t != "\n", normalized=False)
                            for t in IDEFICS3_TOKENS])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<unk>",
                            extra_special_tokens={"image_token": "<image>"},
                            chat_template=IDEFICS3_CHAT_TEMPLATE).save_pretrained(path)


def build_tiny_idefics3(path: str, smolvlm: bool = False, split: bool = True,
                        seed: int = 0, tile: int = 32) -> str:
    """An Idefics3ForConditionalGeneration (or SmolVLMForConditionalGeneration): vision
    transformer on 32x32 images of 8x8 patches (a 4x4 position table), pixel shuffle by 2
    (4 image tokens a 32x32 tile), Llama text model. The image processor resizes an image's
    longest edge to 2 * `tile` and, with `split`, cuts it into `tile` x `tile` tiles plus the
    global image (a 64x32 image: 2 tiles, 48x40: 4); without, it takes the global image
    only. Another `tile` than 32 gives the vision model other patch grids than its table's
    (48: 6x6 patches, 9 tokens a tile)."""
    if smolvlm:
        from transformers import SmolVLMConfig as Config
        from transformers import SmolVLMForConditionalGeneration as Model
        from transformers import SmolVLMImageProcessorPil as ImageProcessor
    else:
        from transformers import Idefics3Config as Config
        from transformers import Idefics3ForConditionalGeneration as Model
        from transformers import Idefics3ImageProcessorPil as ImageProcessor
    torch.manual_seed(seed)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8, initializer_range=0.2)
    text = dict(TINY_LLAMA, num_attention_heads=2, num_key_value_heads=1)
    config = Config(vision_config=vision, text_config=text, scale_factor=2,
                    image_token_id=IDEFICS3_IMAGE_TOKEN_ID, initializer_range=0.2)
    Model(config).eval().save_pretrained(path)
    save_idefics3_tokenizer(path)
    ImageProcessor(size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile},
                   do_image_splitting=split).save_pretrained(path)
    return path
