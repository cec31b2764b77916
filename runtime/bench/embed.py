"""`runtime bench throughput --task embed`: the backends' embedding runs (sentences/s is the
table's req/s). Each runs in the benchmark's fresh process on the spec's token ids (prompts only;
output lengths are ignored).

`hf` runs transformers the way sentence-transformers' `encode` does: inputs sorted by length,
batches of `--hf-batch-size`, padded, the folder's pooling (mean, CLS or last token) over the
attention mask, then normalisation when the folder has a Normalize module.
"""
from __future__ import annotations

import os
import time
from importlib.metadata import version
from typing import Any


def run_runtime_embed(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from runtime import LLM
    llm = LLM(spec["model"], tokenizer=spec.get("tokenizer"), dtype=spec["dtype"],
              num_threads=spec["num_threads"], **{**spec.get("engine", {}), "runner": "pooling"})
    prompts = [{"prompt_token_ids": list(ids)} for ids, _ in spec["requests"]]
    if spec.get("warmup", True):
        llm.embed(prompts[:1])
    start = time.perf_counter()
    llm.embed(prompts)
    return {"version": version("runtime"), "torch_threads": torch.get_num_threads(),
            "elapsed_s": time.perf_counter() - start, "output_tokens": 0}


def run_hf_embed(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel
    from runtime.pooling.pooler import load_pooler_config
    torch.set_num_threads(spec["num_threads"])
    model = AutoModel.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"])).eval()
    decoder = any(a.endswith("ForCausalLM") for a in model.config.architectures or [])
    pooler = load_pooler_config(spec["model"] if os.path.isdir(spec["model"]) else None,
                                encoder_only=not decoder)
    pad = spec["pad_token_id"]
    inputs = sorted((list(ids) for ids, _ in spec["requests"]), key=len, reverse=True)
    size = spec.get("hf_batch_size") or len(inputs)

    def encode(batch: list[list[int]]) -> torch.Tensor:
        width = max(map(len, batch))
        ids = torch.tensor([p + [pad] * (width - len(p)) for p in batch])
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch])
        with torch.inference_mode():
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        if pooler.pooling_type == "MEAN":
            m = mask.unsqueeze(-1).to(hidden.dtype)
            vectors = (hidden * m).sum(1) / m.sum(1)
        elif pooler.pooling_type == "CLS":
            vectors = hidden[:, 0]
        else:
            vectors = hidden[torch.arange(len(batch)), mask.sum(1) - 1]
        return F.normalize(vectors, dim=-1) if pooler.normalize else vectors

    if spec.get("warmup", True):
        encode(inputs[-1:])
    start = time.perf_counter()
    for i in range(0, len(inputs), size):
        encode(inputs[i:i + size])
    return {"version": version("transformers"), "torch_threads": torch.get_num_threads(),
            "elapsed_s": time.perf_counter() - start, "output_tokens": 0,
            "hf_batch_size": size}


EMBED_RUNNERS = {"runtime": run_runtime_embed, "hf": run_hf_embed}
