"""Rotary position embeddings with the Hugging Face rope variants.

Each variant computes the same inverse frequencies and attention scaling as
`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`; cos/sin are then cached in
float32 for every position up to `max_position` and gathered by position, so a
mixed batch of prefills and decodes is rotated in one vectorised step.

Two variants depend on the sequence length in transformers; here they are fixed
once for the engine's `max_position` (every request must see the same rotation,
since keys are rotated once and then live in the KV cache):

* ``dynamic`` (NTK): the base is scaled for ``max(max_position,
  max_position_embeddings)``. Up to the original context this is plain rope and
  equals transformers exactly; past it, it equals transformers for a sequence of
  exactly ``max_position`` tokens (transformers rescales as the sequence grows,
  vLLM fixes it at ``max_position_embeddings * factor``).
* ``longrope``: the long factors are used when ``max_position`` exceeds
  ``original_max_position_embeddings``, the short ones otherwise (transformers
  picks per sequence, by its current length).
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from runtime.plugins.ops import rotary_embedding

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")


def rope_parameters(hf_config: Any) -> dict:
    """Return the config's rope settings as one flat dict.

    Reads ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` + ``rope_theta``
    (older), and always returns ``rope_type`` and ``rope_theta``, plus
    ``partial_rotary_factor`` when the config has one, ``max_position_embeddings``,
    and ``original_max_position_embeddings`` for llama3/yarn/longrope.
    """
    raw = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if any(isinstance(v, dict) for v in raw.values()):
        raise NotImplementedError("rope settings that differ per layer type are not supported")
    params = {k: v for k, v in raw.items() if k != "type"}
    params["rope_type"] = raw.get("rope_type") or raw.get("type") or "default"
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {params['rope_type']!r}; supported: {', '.join(ROPE_TYPES)}")

    default_theta = getattr(hf_config, "default_theta", 10000.0)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or default_theta)
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)

    max_pos = hf_config.max_position_embeddings
    params.setdefault("max_position_embeddings", max_pos)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps the pretraining length at the top level, and transformers prefers it there.
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", max_pos)
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(params: dict, dim: int) -> tuple[torch.Tensor, float]:
    base = params["rope_theta"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = params["max_position_embeddings"] / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, attention_factor


def _longrope(params: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = params["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = params["long_factor"] if max_position > original else params["short_factor"]
    ext_factors = torch.tensor(ext, dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * params["rope_theta"] ** exponents), attention_factor


def _llama3(params: dict, dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _proportional(params: dict, head_size: int) -> torch.Tensor:
    """Gemma 4's global layers: the first `partial_rotary_factor` of the frequencies of a
    full-width rope over `head_size`, the rest zero (those dims are not rotated)."""
    angles = int(params.get("partial_rotary_factor", 1.0) * head_size // 2)
    rotated = 1.0 / (params["rope_theta"] ** (
        torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_size))
    inv_freq = torch.cat((rotated, torch.zeros(head_size // 2 - angles)))
    return inv_freq / params.get("factor", 1.0)


def compute_inv_freq(params: dict, rotary_dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (float32) and the cos/sin scaling for `params`."""
    rope_type, base = params["rope_type"], params["rope_theta"]
    if rope_type == "default":
        return _base_inv_freq(base, rotary_dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, rotary_dim) / params["factor"], 1.0
    if rope_type == "dynamic":
        factor, original = params["factor"], params["max_position_embeddings"]
        seq_len = max(max_position, original)
        base = base * ((factor * seq_len / original) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return _base_inv_freq(base, rotary_dim), 1.0
    if rope_type == "yarn":
        return _yarn(params, rotary_dim)
    if rope_type == "longrope":
        return _longrope(params, rotary_dim, max_position)
    if rope_type == "llama3":
        return _llama3(params, rotary_dim), 1.0
    if rope_type == "proportional":
        return _proportional(params, rotary_dim), 1.0
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate_half) rotary embedding over the first `rotary_dim` dims of each head."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, params: dict, dtype: torch.dtype):
        """`params` is a `rope_parameters` dict. `dtype` is the model's activation dtype; the
        cache stays float32 and the rotation runs in the input's dtype, as in transformers."""
        super().__init__()
        assert rotary_dim <= head_size and rotary_dim % 2 == 0
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        inv_freq, scaling = compute_inv_freq(params, rotary_dim, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [max_position, rotary_dim]

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `query` [T, num_heads, head_size] and `key` [T, num_kv_heads, head_size]
        (flat [T, heads * head_size] also works) by `positions` [T]; returns new tensors."""
        return rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_size)


def get_rope(head_size: int, max_position: int, hf_config: Any, dtype: torch.dtype) -> RotaryEmbedding:
    """The rotary embedding for `hf_config`, with cos/sin cached for `max_position` positions.

    Calls with the same settings (and default device) return the same module, so the
    layers of a model share one cache.
    """
    params = json.dumps(rope_parameters(hf_config), sort_keys=True)
    return _cached_rope(head_size, max_position, params, dtype, str(torch.get_default_device()))


@lru_cache(maxsize=8)
def _cached_rope(
    head_size: int, max_position: int, params_json: str, dtype: torch.dtype, device: str
) -> RotaryEmbedding:
    params = json.loads(params_json)
    rotary_dim = (head_size if params["rope_type"] == "proportional"  # zero frequencies instead
                  else int(head_size * params.get("partial_rotary_factor", 1.0)))
    return RotaryEmbedding(head_size, rotary_dim, max_position, params, dtype)


def table_positions(cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                    axes: torch.Tensor) -> torch.Tensor:
    """Per-token cos | sin [T, rotary_dim] for multi-axis `positions` [A, T]: frequency j
    takes its angle from the position on axis `axes[j]` (`axes`: [rotary_dim // 2])."""
    rows = cos_sin_cache[positions]  # [A, T, rotary_dim]
    index = torch.cat((axes, axes)).expand(1, positions.size(1), -1)
    return rows.gather(0, index).squeeze(0)


class AxialRotary(nn.Module):
    """A ViT's 2-D rotary: of each head's frequencies `inv_freq` ([head_size // 2]), the first
    half turn with the patch's row and the second half with its column (rotate-half layout).
    `op` is the platform's `rotary_embedding` (the portable one when None)."""

    def __init__(self, head_size: int, inv_freq: torch.Tensor, op=None) -> None:
        super().__init__()
        self.head_size, self.inv_freq = head_size, inv_freq
        quarter = head_size // 4
        self.axes = torch.tensor([0] * quarter + [1] * quarter)
        self.op = op or rotary_embedding

    def table(self, rows_cols: torch.Tensor) -> torch.Tensor:
        """cos | sin [N, head_size] of patches at rows_cols [2, N]."""
        angles = torch.arange(int(rows_cols.max()) + 1, dtype=torch.float32)[:, None] \
            * self.inv_freq[None, :]
        cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(rows_cols.device)
        return table_positions(cache, rows_cols, self.axes.to(rows_cols.device))

    def forward(self, table: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotate q and k [N, heads * head_size] in float32, as transformers does."""
        dtype = q.dtype
        rows = torch.arange(table.size(0), device=table.device)
        q, k = self.op(rows, q.float(), k.float(), table, self.head_size)
        return q.to(dtype), k.to(dtype)


def mrope_axes(rotary_dim: int, section: list[int], interleaved: bool = False) -> list[int]:
    """The axis (0: t, 1: h, 2: w) of each of the rotary_dim // 2 frequencies: consecutive
    runs of `section` sizes (Qwen2-VL's `mrope_section`), or with `interleaved` (Qwen3-VL's)
    t, h, w in turn: frequency j = 1 (mod 3) below 3 * section[1] turns with h, j = 2 (mod 3)
    below 3 * section[2] with w, every other with t."""
    if sum(section) != rotary_dim // 2:
        raise ValueError(f"mrope_section {section} must sum to half the rotary dimension "
                         f"({rotary_dim // 2})")
    if not interleaved:
        return [axis for axis, n in enumerate(section) for _ in range(n)]
    axes = [0] * (rotary_dim // 2)
    for axis in (1, 2):
        for j in range(axis, min(3 * section[axis], rotary_dim // 2), 3):
            axes[j] = axis
    return axes


class MRotaryOp:
    """M-RoPE (multimodal rotary: Qwen2-VL's): positions [3, T] hold each token's t, h and w
    position, and each frequency takes its angle from one of them (`mrope_axes`). It runs as
    the plain `rotary_embedding` op over a per-token cos | sin table (positions 0 … T - 1),
    so a platform's rotary kernel takes it as it takes any cache; positions [T] (text, whose
    three rows are equal) go to the op as they are."""

    def __init__(self, op, axes: list[int]) -> None:
        self.op = op
        self.axes = axes
        self._axes_on: dict[torch.device, torch.Tensor] = {}

    def __call__(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 cos_sin_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return self.op(positions, query, key, cos_sin_cache, head_size)
        device = cos_sin_cache.device
        if device not in self._axes_on:
            self._axes_on[device] = torch.tensor(self.axes, device=device)
        table = table_positions(cos_sin_cache, positions, self._axes_on[device])
        rows = torch.arange(positions.size(1), device=device)
        return self.op(rows, query, key, table, head_size)
