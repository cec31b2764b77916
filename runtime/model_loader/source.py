"""Where a model comes from: its config, tokenizer and weights, whatever the file format."""
from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from runtime.default_model import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_ID, default_model_path
from runtime.progress import progress_bar

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """A resolved model: a Hugging Face folder or a GGUF file."""

    path: str
    format: str  # "hf" or "gguf"
    tokenizer_path: str | None = None

    @property
    def name(self) -> str:
        return os.path.basename(self.path.rstrip("/"))


def resolve_model(model: str | None, tokenizer: str | None = None,
                  revision: str | None = None, download_dir: str | None = None) -> ModelSource:
    """None or "default" means the embedded default; a .gguf file or a folder with config.json
    otherwise, or a model id (org/name) already in the local Hugging Face cache (`download_dir`,
    else HF_HUB_CACHE), at `revision`. The default's own hub id falls back to its packaged file
    when the cache does not have it."""
    if revision is not None and model is not None and os.path.exists(model):
        raise ValueError(f"revision {revision!r} applies to a model id in the local Hugging Face "
                         f"cache; {model!r} is a local path")
    if model is None or model == DEFAULT_MODEL_ALIAS:
        model = default_model_path()
    if os.path.isfile(model) and model.endswith(".gguf"):
        return ModelSource(model, "gguf", tokenizer)
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        return ModelSource(model, "hf", tokenizer)
    cached = _from_hf_cache(model, revision, download_dir)
    if cached is not None:
        return ModelSource(cached, "hf", tokenizer)
    if model == DEFAULT_MODEL_ID and revision is None:
        path = default_model_path()
        logger.info("%s is not in the local Hugging Face cache: using the packaged %s", model, path)
        return ModelSource(path, "gguf", tokenizer)
    raise ValueError(f"model {model!r} is neither a .gguf file nor a folder with config.json "
                     "(nothing is downloaded from a model hub: pass a local path)")


def _from_hf_cache(model_id: str, revision: str | None, cache_dir: str | None) -> str | None:
    """The snapshot folder of `model_id` at `revision` in the local Hugging Face cache
    (`cache_dir`, else the default one), if there."""
    if model_id.count("/") != 1 or model_id.startswith((".", "/")):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return snapshot_download(model_id, revision=revision, cache_dir=cache_dir,
                                 local_files_only=True)
    except LocalEntryNotFoundError:
        if revision is not None:
            raise ValueError(f"revision {revision!r} of {model_id!r} is not in the local Hugging "
                             "Face cache (nothing is downloaded)") from None
        return None


def load_config(source: ModelSource, trust_remote_code: bool = False):
    if source.format == "gguf":
        from runtime.model_loader.gguf_loader import load_gguf_config
        return load_gguf_config(source.path)
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    if source.tokenizer_path is None and source.format == "gguf":
        from runtime.model_loader.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(source.path)
    return AutoTokenizer.from_pretrained(source.tokenizer_path or source.path,
                                         trust_remote_code=trust_remote_code)


def iterate_weights(source: ModelSource, hf_config, dtype: torch.dtype,
                    raw_gguf: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, tensor) pairs, one shard file at a time. `raw_gguf`: a GGUF file's
    quantized linear weights come as `runtime.quantization.gguf.GGUFWeight` (GGUF-native method)."""
    if source.format == "gguf":
        from runtime.model_loader.gguf_loader import iterate_gguf_weights
        yield from iterate_gguf_weights(source.path, hf_config, dtype, raw_linear=raw_gguf)
        return
    files = _checkpoint_files(source.path)
    if files[0].endswith(".safetensors"):
        from safetensors import safe_open
        names = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                names[file] = list(f.keys())
        bar = progress_bar(desc="Loading safetensors weights", unit="tensor",
                           total=sum(map(len, names.values())))
        with bar:
            for file in files:
                with safe_open(file, framework="pt") as f:
                    for name in names[file]:
                        yield name, f.get_tensor(name)
                        bar.update(1)
    else:
        for file in progress_bar(files, "Loading checkpoint shards", unit="shard"):
            state = torch.load(file, map_location="cpu", weights_only=True)
            yield from state.items()


def _checkpoint_files(path: str) -> list[str]:
    for index_name, pattern in (("model.safetensors.index.json", "*.safetensors"),
                                ("pytorch_model.bin.index.json", "*.bin")):
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(path, s) for s in shards]
        files = sorted(glob.glob(os.path.join(path, pattern)))
        if files:
            return files
    raise ValueError(f"no *.safetensors or *.bin weights found in {path}")
