"""The architecture of a GGUF file, read from the first bytes of its header.

`gguf.GGUFReader` parses every tensor's description before answering anything (seconds on a
large file); an unsupported file is refused from its `general.architecture` key alone, which
llama.cpp's writer puts among the first key-value pairs.
"""
from __future__ import annotations

import struct
from typing import BinaryIO

# GGUF value type -> struct format of a scalar of that type
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
_ARCHITECTURE_KEY = "general.architecture"


def gguf_architecture(path: str) -> str:
    """`general.architecture` of the GGUF file `path`; ValueError when the file is not GGUF or
    its header has no such key."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        (version,) = struct.unpack("<I", f.read(4))
        order = "<" if version < 0x10000 else ">"  # a big-endian file reads as a huge version
        _, num_kv = struct.unpack(order + "QQ", f.read(16))
        for _ in range(num_kv):
            key = _read_string(f, order)
            (kind,) = struct.unpack(order + "I", f.read(4))
            if key == _ARCHITECTURE_KEY and kind == _STRING:
                return _read_string(f, order)
            _skip_value(f, kind, order)
    raise ValueError(f"{path}: the GGUF header has no {_ARCHITECTURE_KEY}")


def _read_string(f: BinaryIO, order: str) -> str:
    (length,) = struct.unpack(order + "Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _skip_value(f: BinaryIO, kind: int, order: str) -> None:
    if kind in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[kind]), 1)
    elif kind == _STRING:
        (length,) = struct.unpack(order + "Q", f.read(8))
        f.seek(length, 1)
    elif kind == _ARRAY:
        item_kind, count = struct.unpack(order + "IQ", f.read(12))
        if item_kind in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item_kind]), 1)
        else:
            for _ in range(count):
                _skip_value(f, item_kind, order)
    else:
        raise ValueError(f"unknown GGUF value type {kind} in the header")
