"""The offload tier's disk level: one file per block and rank, named by the block's chained hash,
in a folder per KV namespace, so a restarted engine with the same model and settings finds them.

A file is a header (magic, then the JSON description of each layer's block: shape, dtype, and a
blake2b checksum of the payload) followed by the layers' bytes. It is written to a temporary name
and renamed, so a reader never sees half a file; one that does not match (truncated, corrupt, of
another layout) is reported as failed, deleted and recomputed by the engine.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

MAGIC = b"RTKV1\n"


def tier_folder(root: str, namespace: str) -> Path:
    return Path(root) / namespace


def block_path(folder: Path, block_hash: bytes, rank: int) -> Path:
    return folder / f"{block_hash.hex()}.r{rank}"


def scan(folder: Path, world_size: int) -> list[bytes]:
    """The hashes whose files exist for every rank, oldest first (by modification time)."""
    if not folder.is_dir():
        return []
    found: dict[bytes, tuple[int, float]] = {}  # hash -> (ranks seen, newest mtime)
    for entry in os.scandir(folder):
        stem, dot, rank = entry.name.rpartition(".r")
        if not dot or not rank.isdigit() or int(rank) >= world_size:
            continue
        try:
            block_hash = bytes.fromhex(stem)
        except ValueError:
            continue
        seen, mtime = found.get(block_hash, (0, 0.0))
        found[block_hash] = (seen + 1, max(mtime, entry.stat().st_mtime))
    complete = [(mtime, h) for h, (seen, mtime) in found.items() if seen == world_size]
    return [h for _, h in sorted(complete)]


def delete(folder: Path, block_hash: bytes, world_size: int) -> None:
    for rank in range(world_size):
        block_path(folder, block_hash, rank).unlink(missing_ok=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_block(path: Path, blocks: list[torch.Tensor]) -> int:
    """Write one block (a tensor per layer) to `path`; returns the bytes written."""
    payload = b"".join(b.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
                       for b in blocks)
    header = json.dumps({
        "layers": [[list(b.shape), _dtype_name(b.dtype)] for b in blocks],
        "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest(),
    }).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(staging, "wb") as f:
        f.write(MAGIC + len(header).to_bytes(4, "little") + header + payload)
    os.replace(staging, path)
    return len(payload)


def read_block(path: Path, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The block at `path`, one CPU tensor per layer shaped and typed as `like`; None when the
    file is missing, truncated, corrupt or of another layout."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        return None
    start = len(MAGIC) + 4
    size = int.from_bytes(data[len(MAGIC):start], "little")
    try:
        header = json.loads(data[start:start + size])
    except ValueError:
        return None
    payload = memoryview(data)[start + size:]
    expected = [[list(t.shape), _dtype_name(t.dtype)] for t in like]
    if header.get("layers") != expected or header.get("blake2b") != \
            hashlib.blake2b(payload, digest_size=16).hexdigest():
        return None
    blocks, offset = [], 0
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else None
    for t in like:
        n = t.numel() * t.element_size()
        if raw is None or offset + n > raw.numel():
            return None
        blocks.append(raw[offset:offset + n].view(t.dtype).view(t.shape))
        offset += n
    return blocks if offset == len(payload) else None
