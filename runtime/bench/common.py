"""What every bench command shares: the model, dtype and thread count it runs with, the machine
it ran on, and the --output-json / --plot flags."""
from __future__ import annotations

import argparse
import hashlib
import os
import platform as pyplatform
from typing import Any

from runtime.bench.backends import allocator
from runtime.plugins.paths import cache_dir

MODEL_CACHE = str(cache_dir("bench"))


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def model_path(model: str | None) -> str:
    """The model's path: as given, or the embedded default's GGUF file."""
    if model is not None:
        return model
    from runtime.default_model import default_model_path
    return default_model_path()


def resolve_dtype(dtype: str | None, device: str | None = None) -> str:
    """The dtype's torch name ("float32"); None means the platform's default."""
    from runtime.config import parse_dtype
    value = parse_dtype(dtype)
    if value is None:
        from runtime.plugins.selection import select_platform
        value = select_platform(device).default_dtype()
    return str(value).removeprefix("torch.")


def load_tokenizer(model: str, tokenizer: str | None = None) -> Any:
    """The tokenizer the engine would use for `model` (a .gguf file or a Hugging Face folder)."""
    from runtime.model_loader.source import load_tokenizer as load, resolve_model
    return load(resolve_model(model, tokenizer))


def hf_folder(gguf: str, cache_dir: str = MODEL_CACHE) -> str:
    """A Hugging Face folder (fp32 safetensors and tokenizer) made once from a GGUF file, for
    backends that cannot read GGUF; every backend is then pointed at it, so all run one model."""
    stat = os.stat(gguf)
    key = hashlib.sha1(f"{os.path.abspath(gguf)}:{stat.st_size}:{stat.st_mtime}".encode())
    name = os.path.basename(gguf).removesuffix(".gguf")
    folder = os.path.join(cache_dir, f"{name}-{key.hexdigest()[:10]}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    import torch
    from transformers import AutoTokenizer

    from runtime.bench.backends import load_hf_model
    tmp = folder + ".tmp"
    model = load_hf_model(gguf, torch.float32)
    model.hf_quantizer = None  # the weights are dequantized already: save them as plain fp32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)) \
        .save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


def machine_info(num_threads: int) -> dict[str, Any]:
    """The facts a reader needs to compare figures from two runs."""
    import torch
    from runtime.platforms.cpu.platform import read_cpuinfo
    cpu = read_cpuinfo()
    return {"cpu": cpu.model_name, "features": sorted(cpu.features), "cores": usable_cores(),
            "threads": num_threads, "allocator": allocator(), "torch": torch.__version__,
            "python": pyplatform.python_version(), "load_average": os.getloadavg()[0]}


def busy_warning(machine: dict[str, Any]) -> str | None:
    """A warning when other work was running: OpenMP threads that find their cores taken can
    run an order of magnitude slower, so such figures compare with nothing."""
    if machine["load_average"] <= 0.5 * machine["cores"]:
        return None
    return (f"warning: the machine was busy (load average {machine['load_average']:.1f} on "
            f"{machine['cores']} cores) when the run started; measure on a quiet machine")


ALLOCATOR_NOTE = ("note: glibc malloc with its default mmap threshold serves large tensors "
                  "through mmap, which can slow CPU inference several-fold; for comparable "
                  "figures run every backend under one of GLIBC_TUNABLES=glibc.malloc."
                  "mmap_threshold=<bytes> or LD_PRELOAD=<libjemalloc.so|libtcmalloc.so>")


def add_output_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("output")
    g.add_argument("--output-json", default=None, help="write the results to this JSON file")
    g.add_argument("--plot", default=None, help="draw the results to this PNG file")
