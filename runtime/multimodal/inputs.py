"""What a request carries of each multimodal item: where its placeholder tokens are, the
content hash that names it (encoder cache and prefix-cache keys), and the processor's tensors
the encoder reads. Plain data, picklable and msgpack-able."""
from __future__ import annotations

import hashlib

import msgspec
import torch


class TensorData(msgspec.Struct, array_like=True, frozen=True):
    """A tensor as bytes, so it crosses processes in any of our messages."""

    shape: list[int]
    dtype: str
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorData":
        tensor = tensor.detach().contiguous().cpu()
        return cls(list(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                   tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")

    def digest(self) -> bytes:
        """A content hash (shape, dtype and bytes): equal tensors share it, different ones
        never do (an embeddings prompt's prefix-cache chain starts from it)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"tensor:{self.dtype}:{self.shape}".encode())
        h.update(self.data)
        return h.digest()

    def tensor(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=dtype).view(self.shape)


class MultiModalFeature(msgspec.Struct, array_like=True, frozen=True):
    """One item of a prompt: its embeddings replace the prompt tokens
    [offset, offset + length), all of them the model's placeholder token."""

    modality: str  # "image"
    identifier: str  # the content hash of the item and of how it was processed
    offset: int
    length: int
    data: dict[str, TensorData]  # the processor's output for this item (pixel_values ...)
    # M-RoPE models (Qwen2-VL): the item's (t, h, w) extent in position units, whose
    # positions its placeholders take (runtime.multimodal.mrope); None for other models
    mrope_grid: list[int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its placeholders lies in the token range [start, end)."""
        return self.offset < end and start < self.end

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: t.tensor() for name, t in self.data.items()}
