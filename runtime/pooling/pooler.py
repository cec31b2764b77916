"""How a pooling model turns hidden states into one vector per request: the sentence-transformers
files of the model folder (`modules.json`, `1_Pooling/config.json`, `sentence_bert_config.json`)
or, without them, vLLM's defaults (CLS for encoders, last token for decoders; normalised)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

POOLING_TYPES = ("CLS", "MEAN", "LAST")
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_lasttoken": "LAST"}
_ST_MODULES = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
               "sentence_transformers.models.Normalize")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str
    normalize: bool
    max_seq_length: int | None = None  # sentence-transformers' limit, below the model's


def _read_json(path: str) -> dict | list | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def is_sentence_transformers(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "modules.json"))


def load_pooler_config(folder: str | None, encoder_only: bool) -> PoolerConfig:
    """The folder's sentence-transformers pooling; raises ValueError for a pipeline this runner
    does not reproduce (a Dense projection, several pooling modes at once)."""
    default = PoolerConfig("CLS" if encoder_only else "LAST", True)
    modules = _read_json(os.path.join(folder, "modules.json")) if folder else None
    if not modules:
        return default
    pooling_type, normalize = default.pooling_type, False
    for module in modules:
        kind = module.get("type", "")
        if kind not in _ST_MODULES:
            raise ValueError(f"sentence-transformers module {kind!r} is not supported; "
                             f"supported: {', '.join(_ST_MODULES)}")
        if kind.endswith("Normalize"):
            normalize = True
        if kind.endswith("Pooling"):
            config = _read_json(os.path.join(folder, module.get("path", ""), "config.json"))
            modes = [name for key, name in _ST_MODES.items() if (config or {}).get(key)]
            others = [k for k, v in (config or {}).items()
                      if k.startswith("pooling_mode") and v and k not in _ST_MODES]
            if len(modes) != 1 or others:
                raise ValueError(f"pooling modes {modes + others} are not supported: exactly "
                                 f"one of {', '.join(_ST_MODES)} is")
            pooling_type = modes[0]
    st = _read_json(os.path.join(folder, "sentence_bert_config.json")) or {}
    return PoolerConfig(pooling_type, normalize, st.get("max_seq_length"))


def pool_rows(rows: list[torch.Tensor], pooling_type: str) -> torch.Tensor:
    """One vector per request from its hidden states [its tokens, hidden]."""
    if pooling_type == "CLS":
        return torch.stack([x[0] for x in rows])
    if pooling_type == "LAST":
        return torch.stack([x[-1] for x in rows])
    return torch.stack([x.mean(0, dtype=torch.float32) for x in rows])


def finish_embedding(vector: torch.Tensor, dimensions: int | None,
                     normalize: bool) -> torch.Tensor:
    """Matryoshka truncation to `dimensions`, then L2 normalisation when asked."""
    vector = vector.float()
    if dimensions is not None:
        vector = vector[..., :dimensions]
    return F.normalize(vector, dim=-1) if normalize else vector
