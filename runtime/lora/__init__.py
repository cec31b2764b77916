"""Multi-LoRA: PEFT adapters served from one base model, mixed per token in one batch."""
from runtime.lora.request import LoRARequest

__all__ = ["LoRARequest"]
