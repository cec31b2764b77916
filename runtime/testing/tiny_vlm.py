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


def save_word_tokenizer(path: str, tokens: list[str], extra_special_tokens: dict[str, str],
                        chat_template: str = CHAT_TEMPLATE) -> None:
    """Word-level: <unk> <s> </s>, then `tokens` from id 3 as added tokens (special ones, but
    a newline), then made-up words "wN" (N their id) up to VOCAB_SIZE."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({t: 3 + i for i, t in enumerate(tokens)})
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=t != "\n", normalized=False) for t in tokens])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<unk>",
                            extra_special_tokens=extra_special_tokens,
                            chat_template=chat_template).save_pretrained(path)


def random_image(seed: int, size: tuple[int, int] = (48, 40)):
    """A random RGB PIL image of `size` (width, height)."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


QWEN_VL_TOKENS = {"<|image_pad|>": 3, "<|vision_start|>": 4, "<|vision_end|>": 5,
                  "<|video_pad|>": 6}
QWEN_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # an image in a Qwen-VL prompt


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
    # the vision tokens special, so that a run of <|image_pad|> with no spaces between splits
    save_word_tokenizer(path, list(QWEN_VL_TOKENS), {"image_token": "<|image_pad|>",
                                                     "video_token": "<|video_pad|>"})
    Qwen2VLImageProcessorPil(patch_size=vision["patch_size"], merge_size=2,
                             temporal_patch_size=2).save_pretrained(path)
    return path


LLAVA_NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64]]


def build_tiny_llava_next(path: str, text_model: str = "llama", seed: int = 0) -> str:
    """A LlavaNextForConditionalGeneration: CLIP tower over 32x32 tiles of 8x8 patches (16 per
    tile), tile grids `LLAVA_NEXT_PINPOINTS` (a 48x40 image: 70 image tokens), a Llama
    (or `text_model` "qwen2": Qwen2) language model, the LLaVA-NeXT image processor (PIL)."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaNextConfig,
                              LlavaNextForConditionalGeneration, LlavaNextImageProcessorPil,
                              Qwen2Config)
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, image_size=32, patch_size=8,
                              projection_dim=64, initializer_range=0.2)
    text_config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[text_model]
    text = text_config(**{**TINY_LLAMA, "num_attention_heads": 2, "num_key_value_heads": 1})
    config = LlavaNextConfig(vision_config=vision, text_config=text,
                             image_token_index=IMAGE_TOKEN_ID, initializer_range=0.2,
                             image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    model = LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers draws image_newline with a std of 1/sqrt(hidden)
        model.model.image_newline.normal_(0, 0.2)
    model.save_pretrained(path)
    save_vlm_tokenizer(path)
    LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                               image_grid_pinpoints=LLAVA_NEXT_PINPOINTS).save_pretrained(path)
    return path


MISTRAL3_TOKENS = {"[IMG]": 3, "[IMG_BREAK]": 4, "[IMG_END]": 5}
MISTRAL3_IMAGE = "[IMG]"  # an image in a Mistral 3 prompt


def build_tiny_mistral3(path: str, seed: int = 0) -> str:
    """A Mistral3ForConditionalGeneration: Pixtral encoder of 8-pixel patches (2 layers, gated
    GELU MLP), patches merged 2x2, a Mistral language model, the Pixtral image processor (PIL;
    the engine resizes to multiples of 16 pixels, images up to 64): a 48x40 image is 3x3
    merged patches, 12 tokens with its [IMG_BREAK]s and [IMG_END]."""
    from transformers import (Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig,
                              PixtralImageProcessorPil, PixtralVisionConfig)
    torch.manual_seed(seed)
    vision = PixtralVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, image_size=64, patch_size=8,
                                 initializer_range=0.2)
    text = MistralConfig(**{**TINY_LLAMA, "num_attention_heads": 2, "num_key_value_heads": 1,
                            "sliding_window": None})
    config = Mistral3Config(vision_config=vision, text_config=text, initializer_range=0.2,
                            image_token_index=MISTRAL3_TOKENS["[IMG]"], spatial_merge_size=2,
                            vision_feature_layer=-1, tie_word_embeddings=False)
    Mistral3ForConditionalGeneration(config).eval().save_pretrained(path)
    save_word_tokenizer(path, list(MISTRAL3_TOKENS), {"image_token": MISTRAL3_IMAGE})
    PixtralImageProcessorPil(patch_size={"height": 8, "width": 8},
                             size={"longest_edge": 64}).save_pretrained(path)
    return path


def save_qwen3_5_tokenizer(path: str) -> None:
    """transformers makes every qwen3_5 folder's tokenizer its byte-level BPE
    `Qwen3_5Tokenizer` (the tokenizer file's vocabulary and merges, its own pre-tokenizer), so
    this one is byte-level too: Qwen-VL's vision tokens as special tokens, then the 256 byte
    symbols (one token per byte: no merges), then unused tokens up to VOCAB_SIZE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **QWEN_VL_TOKENS}
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab.update({c: len(vocab) + i for i, c in enumerate(symbols)})
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), VOCAB_SIZE)})
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in QWEN_VL_TOKENS])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<unk>",
                            extra_special_tokens={"image_token": "<|image_pad|>",
                                                  "video_token": "<|video_pad|>"},
                            chat_template=CHAT_TEMPLATE).save_pretrained(path)


def build_tiny_qwen3_5_vl(path: str, moe: bool = False, seed: int = 0) -> str:
    """A Qwen3_5ForConditionalGeneration (`moe`: Qwen3_5MoeForConditionalGeneration, 4
    experts, top 2, a shared expert): Qwen3-VL's vision tower without DeepStack (16-pixel
    patches merged 2x2, a 4x4 learned position table: a 56x56 image gives 4 image tokens, a
    112x84 one 12) and a hybrid text model of a gated delta-net then gated attention, half of
    each 32-dim head rotated by interleaved M-RoPE sections (4, 2, 2); a byte-level
    tokenizer (`save_qwen3_5_tokenizer`)."""
    from transformers import Qwen2VLImageProcessorPil
    torch.manual_seed(seed)
    text = dict(TINY_LLAMA, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})
    if moe:
        from transformers import Qwen3_5MoeConfig as Config
        from transformers import Qwen3_5MoeForConditionalGeneration as Model
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48)
    else:
        from transformers import Qwen3_5Config as Config
        from transformers import Qwen3_5ForConditionalGeneration as Model
    vision = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=64,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=16, initializer_range=0.2)
    config = Config(text_config=text, vision_config=vision, image_token_id=3,
                    vision_start_token_id=4, vision_end_token_id=5, video_token_id=6,
                    initializer_range=0.2)
    Model(config).eval().save_pretrained(path)
    save_qwen3_5_tokenizer(path)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2
                             ).save_pretrained(path)
    return path


IDEFICS3_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                   "\n"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
IDEFICS3_IMAGE_TOKEN_ID = 3
# Idefics3's template: a message's content is a list of parts, an image part prints <image>
IDEFICS3_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %} {{ part['text'] }}{% endif %}"
    "{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}w50:{% endif %}")


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
    save_word_tokenizer(path, IDEFICS3_TOKENS, {"image_token": "<image>"}, IDEFICS3_CHAT_TEMPLATE)
    ImageProcessor(size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile},
                   do_image_splitting=split).save_pretrained(path)
    return path


GEMMA3_TOKENS = {"<start_of_image>": 3, "<end_of_image>": 4, "<image_soft_token>": 5}
GEMMA3_IMAGE = "<start_of_image>"  # an image in a Gemma 3 prompt


def build_tiny_gemma3_vl(path: str, seed: int = 0) -> str:
    """A Gemma3ForConditionalGeneration: SigLIP tower (32x32 images, 8x8 patches: a 4x4
    grid), average-pooled to 4 image tokens; Gemma 3 text with a 4-token sliding window in
    layer 0 and global attention in layer 1; the Gemma 3 image processor (PIL backend)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    torch.manual_seed(seed)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8, vision_use_head=False,
                  initializer_range=0.2)
    text = dict(TINY_LLAMA, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                query_pre_attn_scalar=32, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"])
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=3, eoi_token_index=4, image_token_index=5,
                          initializer_range=0.2)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers initialises the projection to zeros
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    model.save_pretrained(path)
    save_word_tokenizer(path, list(GEMMA3_TOKENS), {"boi_token": "<start_of_image>",
                                                    "eoi_token": "<end_of_image>",
                                                    "image_token": "<image_soft_token>"})
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    return path


GEMMA4_TOKENS = {"<|image>": 3, "<image|>": 4, "<|image|>": 5}
GEMMA4_IMAGE = "<|image|>"


def build_tiny_gemma4_vl(path: str, seed: int = 0, bidirectional: str | None = "vision") -> str:
    """A Gemma4ForConditionalGeneration, images only: the Gemma 4 vision encoder (4-pixel
    patches, 2x2 pooling, clipped linears, standardization) and Gemma 4 text (a 4-token
    sliding window in layer 0, global attention in layer 1, per-layer embeddings), image
    tokens attending both ways in the sliding layers (`bidirectional`); the Gemma 4 image
    processor (PIL backend) at 70 soft tokens at most: a 48x40 image takes 63."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    torch.manual_seed(seed)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, patch_size=4,
                  pooling_kernel_size=2, position_embedding_size=32, use_clipped_linears=True,
                  standardize=True, initializer_range=0.2)
    text = dict(TINY_LLAMA, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                global_head_dim=32, sliding_window=4, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=VOCAB_SIZE, use_bidirectional_attention=bidirectional,
                layer_types=["sliding_attention", "full_attention"])
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                          boi_token_id=3, eoi_token_id=4, image_token_id=5,
                          initializer_range=0.2)
    model = Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():  # random clip bounds and standardization that take effect
        tower = model.model.vision_tower
        for name, buffer in tower.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buffer.fill_(-2.0)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(2.0)
        tower.std_bias.normal_(0, 0.2)
        tower.std_scale.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    save_word_tokenizer(path, list(GEMMA4_TOKENS), {"boi_token": "<|image>",
                                                    "eoi_token": "<image|>",
                                                    "image_token": GEMMA4_IMAGE})
    Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2,
                            max_soft_tokens=70).save_pretrained(path)
    return path
