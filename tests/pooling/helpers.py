"""Tiny pooling models and their transformers references."""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

# token ids (no 0 or 1: RoBERTa's padding id would shift transformers' positions), mixed lengths
PROMPTS = [[5, 77, 301, 2048, 9],
           list(range(300, 341)),
           [1000 + 7 * i for i in range(90)],
           [42, 43],
           [9690, 28, 2683, 253, 1377] * 4]


def write_sentence_transformers(path: str, mode: str, normalize: bool) -> None:
    """modules.json and 1_Pooling/config.json as sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    flags = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
             "last": "pooling_mode_lasttoken"}
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({key: name == mode for name, key in flags.items()}, f)


def hf_hidden(model, ids: list[int]) -> torch.Tensor:
    """transformers' last hidden states [len, hidden] of one unpadded input."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].float()


def hf_pool(hidden: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    vector = {"cls": hidden[0], "mean": hidden.mean(0), "last": hidden[-1]}[mode]
    return F.normalize(vector, dim=-1) if normalize else vector


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str, atol: float = 1e-4) -> None:
    """Max abs difference under `atol` (float32 both sides) and cosine >= 0.9999."""
    diff = (ours - ref).abs().max().item()
    cos = F.cosine_similarity(ours.flatten(), ref.flatten(), dim=0).item()
    assert diff < atol and cos >= 0.9999, f"{what}: max abs diff {diff:.2e}, cosine {cos:.6f}"
