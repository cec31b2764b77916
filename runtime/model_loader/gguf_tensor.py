"""Where one tensor of a hybrid GGUF file goes in the model, and how it is turned back into
the checkpoint's form (`gguf_loader` applies it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HybridTensor:
    """Where one GGUF tensor goes: `name`, reshaped by `reshape`, transformed by `transform`;
    with `merge` (part, parts, dim), it is one of `parts` pieces concatenated along `dim`."""
    name: str
    reshape: str | None = None  # "conv": [C, K] -> [C, 1, K]; "flat": -> [n]
    # "a_log": A -> log(-A); "permute_q" / "permute_k": llama's rows; "minus_one": 1 + w -> w;
    # "v_heads_<part>": Qwen3.5's tiled value heads; several steps joined by "+"
    transform: str | None = None
    merge: tuple[int, int, int] | None = None
