"""Images given as their embeddings (`enable_mm_embeds`, vLLM's `--enable-mm-embeds`): the
projected image features the language model takes at the image's placeholders, computed
elsewhere, so the vision encoder never runs for them.

An item is a tensor [tokens, width] (a [images, tokens, width] tensor is one item per image),
or vLLM's dict form {"image_embeds": tensor, "image_grid_thw": tensor} for the models whose
positions need the image's grid (the Qwen-VL family: M-RoPE). Over the server each tensor is
base64 of a `torch.save`d tensor, read with `weights_only` (no code runs). `width` is the text
hidden size, times (1 + DeepStack layers) for Qwen3-VL (the main part and each DeepStack part
side by side, as our encoder gives them). The item's identifier hashes the tensors' bytes, so
the encoder cache and the prefix cache key it by content as any image.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from runtime.multimodal.inputs import MultiModalFeature, TensorData
from runtime.multimodal.media import MediaError
from runtime.multimodal.wire import EMBEDDING_DTYPES, decode_tensor

FLAG = "enable_mm_embeds=True (--enable-mm-embeds)"
EMBEDS_KEY = "image_embeds"
GRID_KEY = "image_grid_thw"


def is_embeds_item(item: Any) -> bool:
    return isinstance(item, torch.Tensor) or (isinstance(item, dict) and EMBEDS_KEY in item)


def image_items(images: Any) -> list[Any]:
    """The items of `multi_modal_data["image"]`: a list, a [images, tokens, width] tensor, or
    one item."""
    if isinstance(images, (list, tuple)):
        return list(images)
    if isinstance(images, torch.Tensor) and images.dim() == 3:
        return list(images)
    return [images]


def embeds_width(hf_config: Any) -> int:
    """The width of an image embedding row of this model."""
    deepstack = getattr(hf_config.vision_config, "deepstack_visual_indexes", None) or ()
    return hf_config.get_text_config().hidden_size * (1 + len(deepstack))


def embeds_feature(item: Any, layout: Any, width: int, enabled: bool) -> MultiModalFeature:
    """The item (tensors or base64 strings) as a feature at offset 0 whose data holds its
    embeddings; MediaError naming what is wrong."""
    if not enabled:
        raise MediaError(f"image embeddings were given, but this engine takes none: start it "
                         f"with {FLAG}")
    fields = dict(item) if isinstance(item, dict) else {EMBEDS_KEY: item}
    allowed = {EMBEDS_KEY, GRID_KEY} if layout.mrope else {EMBEDS_KEY}
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise MediaError(f"image embeddings have {', '.join(map(repr, unknown))}, which this "
                         f"model does not take; it takes: {', '.join(sorted(allowed))}")
    embeds = _check_embeds(_tensor(fields[EMBEDS_KEY], EMBEDS_KEY), width)
    data = {EMBEDS_KEY: TensorData.of(embeds)}
    length, grid = embeds.size(0), None
    if layout.mrope:
        if GRID_KEY not in fields:
            raise MediaError(f"this model's image embeddings need their {GRID_KEY!r} (the "
                             f"image's (t, h, w) in patches, for its positions): send "
                             f"{{{EMBEDS_KEY!r}: ..., {GRID_KEY!r}: ...}}")
        thw = _check_grid(_tensor(fields[GRID_KEY], GRID_KEY), layout.merge)
        length = layout.num_tokens({GRID_KEY: thw})
        if embeds.size(0) != length:
            raise MediaError(f"image embeddings have {embeds.size(0)} rows, but their "
                             f"{GRID_KEY} {thw.tolist()} gives {length} image tokens")
        data[GRID_KEY] = TensorData.of(thw)
        grid = layout.mrope_grid({GRID_KEY: thw})
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(data):
        h.update(data[name].digest())
    return MultiModalFeature("image", "embeds:" + h.hexdigest(), 0, length, data, grid)


def _tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, (str, bytes)):
        try:
            return decode_tensor(value, name)
        except ValueError as e:
            raise MediaError(str(e)) from None
    if not isinstance(value, torch.Tensor):
        raise MediaError(f"{name} must be a torch.Tensor (or, over the server, base64 of a "
                         f"torch.save()d tensor), got {type(value).__name__}")
    return value


def _check_embeds(tensor: torch.Tensor, width: int) -> torch.Tensor:
    if tensor.dtype not in EMBEDDING_DTYPES:
        raise MediaError(f"{EMBEDS_KEY} must be float32, bfloat16 or float16, got "
                         f"{str(tensor.dtype).removeprefix('torch.')}")
    if tensor.dim() != 2:
        raise MediaError(f"{EMBEDS_KEY} of one image must be 2-D [tokens, {width}], got shape "
                         f"{list(tensor.shape)}")
    if tensor.size(1) != width:
        raise MediaError(f"{EMBEDS_KEY} rows must be {width} wide (the model's image "
                         f"embedding width), got {tensor.size(1)}")
    if tensor.size(0) == 0:
        raise MediaError(f"{EMBEDS_KEY} is empty: an image takes at least one token")
    if not bool(torch.isfinite(tensor).all()):
        raise MediaError(f"{EMBEDS_KEY} holds values that are not finite (nan or inf)")
    return tensor


def _check_grid(tensor: torch.Tensor, merge: int) -> torch.Tensor:
    thw = tensor.reshape(-1) if tensor.numel() == 3 else tensor
    if thw.shape != (3,) or thw.dtype.is_floating_point or thw.dtype == torch.bool:
        raise MediaError(f"{GRID_KEY} must be 3 integers (t, h, w) for one image, got "
                         f"{thw.dtype} of shape {list(tensor.shape)}")
    thw = thw.to(torch.int64)
    t, h, w = thw.tolist()
    if t != 1 or h <= 0 or w <= 0 or h % merge or w % merge:
        raise MediaError(f"{GRID_KEY} {thw.tolist()}: an image has t = 1 and h, w positive "
                         f"multiples of the merge size {merge}")
    return thw
