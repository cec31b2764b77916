"""What a request names to run under an adapter (vLLM's `LoRARequest`)."""
from __future__ import annotations

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
