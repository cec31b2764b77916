"""What a request names to run under an adapter (vLLM's `LoRARequest`)."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`).

    `lora_int_id` (>= 1) identifies the adapter to the engine: two requests with the same id
    share its device slot and their prefix-cache blocks; different ids never share blocks.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")


def parse_lora_modules(values: list[str] | None) -> dict[str, LoRARequest]:
    """`--lora-modules` entries, `name=path` or vLLM's JSON `{"name": ..., "path": ...}`, as
    adapters numbered 1, 2, ... in the order given."""
    modules: dict[str, LoRARequest] = {}
    for value in values or []:
        if value.lstrip().startswith("{"):
            entry = json.loads(value)
            if not isinstance(entry, dict) or "name" not in entry or "path" not in entry:
                raise ValueError(f"--lora-modules JSON needs \"name\" and \"path\", got {value}")
            name, path = entry["name"], entry["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules takes name=path or JSON, got {value!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = LoRARequest(name, len(modules) + 1, path)
    return modules
