"""Random (non-zero) PEFT adapters for a tiny Llama, and transformers + PEFT's greedy outputs
under each as the reference."""
from __future__ import annotations

import torch

from parity import hf_greedy

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1] + list(range(100, 130)), [1, 7, 8],
           [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315,
            316, 317, 318]]
MAX_TOKENS = 8
# name -> LoraConfig keywords: some attention and MLP projections, plain and rsLoRA scaling
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=4, lora_alpha=8, use_rslora=True,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj"]),
    "mlp": dict(r=16, lora_alpha=32, target_modules=["o_proj", "gate_proj", "down_proj"]),
}


def save_adapter(base: str, path: str, seed: int, **lora_kwargs) -> str:
    """A PEFT adapter with random A and B (PEFT's default B is zero: no effect to test)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


def peft_greedy(base: str, adapter: str | None) -> list[tuple[list[int], list[float]]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
