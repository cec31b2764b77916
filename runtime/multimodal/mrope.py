"""M-RoPE positions (Qwen2-VL's multimodal rotary), as transformers' `get_rope_index` gives
them: text tokens take one position on all three rows (t, h, w); an item's placeholders
take the item's start position plus their frame, row and column in its grid; the text after
an item continues from the item's largest position + 1, so every later token (generated ones
too) sits `delta` = sum over items of (max(h, w) - length) away from its index.

They depend only on the token's index and the items before it, so a chunk, a prefix-cache
hit or a resumed request computes the positions of its own tokens, from its items alone.
"""
from __future__ import annotations

import numpy as np

from runtime.multimodal.inputs import MultiModalFeature


def mrope_positions(features: list[MultiModalFeature], start: int, end: int) -> np.ndarray:
    """[3, end - start] int64: the positions of tokens [start, end) of a request whose items
    (in prompt order, each with its `mrope_grid`) are `features`."""
    out = np.tile(np.arange(start, end, dtype=np.int64), (3, 1))
    shift = 0  # position minus index of the text after the items so far
    for f in features:
        t, h, w = f.mrope_grid
        lo, hi = max(start, f.offset), min(end, f.end)
        if lo < hi:
            j = np.arange(lo - f.offset, hi - f.offset)
            out[:, lo - start:hi - start] = f.offset + shift + np.stack(
                (j // (h * w), j // w % h, j % w))
        step = max(h, w) - f.length
        shift += step
        out[:, max(start, f.end) - start:] += step
    return out

