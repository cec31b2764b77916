"""`runtime bench compute`: how close the engine comes to the machine's arithmetic peak.

The peak is measured, not looked up: the best of a few square matmuls per dtype at the engine's
thread count. The engine's achieved rate is the model's FLOPs (counted from its config) divided
by the wall time of real engine steps, scheduling and sampling included:

- per token: 2 x the decoder's matmul weights (q, k, v, o, gate, up, down), plus attention,
  4 x layers x heads x head_dim per key attended (QK^T and PV), causal;
- per sampled token: 2 x hidden x vocab for the LM head (a prefill samples once per prompt).

Prefill runs `--prefill-batch` prompts of `--prefill-len` tokens, one output token each; decode
runs `--decode-batch` requests and times only the steps after every prompt is in the cache.
Sliding windows and embeddings are not counted.

Decode is also put on a roofline: the bytes a step must read (every matmul weight and the LM
head once, plus each sequence's K and V of every layer) over its time, against the machine's
read bandwidth, measured as the best of a few sums over a buffer far larger than the caches.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from runtime.bench import common
from runtime.bench.datasets import random_requests
from runtime.bench.metrics import format_table, write_json
from runtime.cli.engine_args import add_engine_args, engine_kwargs


@dataclass
class FlopModel:
    """FLOPs of one forward token of a dense decoder (Llama, Qwen, Mistral ...)."""

    linear_params: int  # matmul weights of all decoder layers
    lm_head_params: int
    attention_per_key: int
    kv_elements_per_key: int = 0  # K and V elements of one position, all layers

    @classmethod
    def from_config(cls, hf_config: Any) -> "FlopModel":
        h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or h // heads
        per_layer = (2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
                     + 3 * h * hf_config.intermediate_size)
        return cls(layers * per_layer, h * hf_config.vocab_size, 4 * layers * heads * head_dim,
                   2 * layers * kv_heads * head_dim)

    def token(self, position: int, sampled: bool) -> int:
        """The token at `position` (0-based) attends to position + 1 keys."""
        return (2 * self.linear_params + self.attention_per_key * (position + 1)
                + (2 * self.lm_head_params if sampled else 0))

    def prefill(self, length: int) -> int:
        """A whole prompt of `length` tokens, sampling once at its end."""
        return (2 * self.linear_params * length
                + self.attention_per_key * length * (length + 1) // 2
                + 2 * self.lm_head_params)


def matmul_peak(dtype: Any, size: int, reps: int = 3) -> float:
    """FLOP/s of the best of `reps` size x size products (after one warm-up), torch's matmul
    or oneDNN's with a pre-packed weight, whichever is faster here (MKL's sgemm takes no AVX-512
    path on AMD CPUs, where the packed product, which the engine uses, is 2x faster). oneDNN
    packs bfloat16 only on AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT CPUs."""
    import torch
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    products = [lambda: torch.matmul(a, b)]
    packs = dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if torch.backends.mkldnn.is_available() and packs:
        packed = torch.ops.mkldnn._reorder_linear_weight(b, size)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none",
                                                                   [], ""))
    best = float("inf")
    for product in products:
        product()
        for _ in range(reps):
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def read_bandwidth(size_bytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes/s of the best of `reps` float32 sums over `size_bytes` (after one warm-up): the
    rate the machine streams memory that no cache holds, on the current thread count."""
    import torch
    buffer = torch.ones(size_bytes // 4)
    buffer.sum()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return size_bytes / best


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--bandwidth-mib", type=int, default=1024,
                        help="size of the buffer the read bandwidth is measured on")
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-len", type=int, default=128, help="decode: prompt tokens")
    parser.add_argument("--decode-steps", type=int, default=32, help="decode: timed steps")
    add_engine_args(parser)
    common.add_output_args(parser)


def _params(n: int):
    from runtime.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def measure_prefill(engine: Any, flops: FlopModel, prompts: list[list[int]]) -> dict[str, float]:
    start = time.perf_counter()
    for ids in prompts:
        engine.add_request({"prompt_token_ids": ids}, _params(1))
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    total = sum(flops.prefill(len(ids)) for ids in prompts)
    tokens = sum(map(len, prompts))
    return {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "gflops": total / elapsed / 1e9}


def measure_decode(engine: Any, flops: FlopModel, prompts: list[list[int]], steps: int,
                   weight_bytes: int, kv_bytes_per_key: int) -> dict[str, float]:
    """Time the steps after every prompt has its first token; count each decoded token's FLOPs
    at its own position, and the bytes its step reads: the weights once per step, and the K
    and V of every position the token attends to."""
    ids = [engine.add_request({"prompt_token_ids": p}, _params(steps + 1)) for p in prompts]
    length = {i: len(p) for i, p in zip(ids, prompts)}
    generated = dict.fromkeys(ids, 0)
    start, total, tokens, moved = None, 0, 0, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if start is not None and outputs:
            moved += weight_bytes
        for out in outputs:
            now = len(out.outputs[0].token_ids)
            if start is not None:
                for k in range(generated[out.request_id], now):
                    position = length[out.request_id] + k - 1
                    total += flops.token(position, sampled=True)
                    moved += kv_bytes_per_key * (position + 1)
                    tokens += 1
            generated[out.request_id] = now
        if start is None and all(generated.values()):
            start = time.perf_counter()
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tokens": tokens, "batch": len(prompts),
            "tokens_per_s": tokens / elapsed, "gflops": total / elapsed / 1e9,
            "gbytes_per_s": moved / elapsed / 1e9}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from runtime.attention_backends.base import kv_cache_torch_dtype
    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine
    machine = common.machine_info(args.num_threads or torch.get_num_threads())
    kwargs = engine_kwargs(args)
    kwargs["max_num_seqs"] = max(kwargs["max_num_seqs"], args.decode_batch)
    kwargs["enable_prefix_caching"] = False  # random prompts; every token must be computed
    engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    threads = torch.get_num_threads()
    dtype = engine.model_config.dtype
    peaks = {name: matmul_peak(d, args.matmul_size) / 1e9
             for name, d in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    flops = FlopModel.from_config(engine.model_config.hf_config)
    tok = engine.tokenizer
    prefill_prompts = [r.prompt_token_ids for r in random_requests(
        tok, args.prefill_batch, args.prefill_len, 1, seed=1)]
    decode_prompts = [r.prompt_token_ids for r in random_requests(
        tok, args.decode_batch, args.decode_len, 1, seed=2)]
    measure_prefill(engine, flops, prefill_prompts[:1])  # warm-up
    prefill = measure_prefill(engine, flops, prefill_prompts)
    kv_dtype = kv_cache_torch_dtype(engine.config.kv_cache_dtype, dtype)
    decode = measure_decode(engine, flops, decode_prompts, args.decode_steps,
                            (flops.linear_params + flops.lm_head_params) * dtype.itemsize,
                            flops.kv_elements_per_key * kv_dtype.itemsize)
    name = str(dtype).removeprefix("torch.")
    peak = peaks.get(name) or matmul_peak(dtype, args.matmul_size) / 1e9
    for phase in (prefill, decode):
        phase["share_of_peak"] = phase["gflops"] / peak
    bandwidth = read_bandwidth(args.bandwidth_mib << 20) / 1e9
    decode["share_of_bandwidth"] = decode["gbytes_per_s"] / bandwidth
    return {"command": "compute", "model": engine.source.path, "dtype": name,
            "num_threads": threads, "peak_gflops": peaks, "read_gbytes_per_s": bandwidth,
            "prefill": prefill, "decode": decode,
            "flops_per_token_linear": 2 * flops.linear_params,
            "flops_lm_head": 2 * flops.lm_head_params,
            "machine": machine}


def report(result: dict[str, Any]) -> str:
    peaks = ", ".join(f"{k} {v:.1f}" for k, v in result["peak_gflops"].items())
    rows = [{"phase": f"prefill ({result['prefill']['tokens']} tokens)", **result["prefill"]},
            {"phase": f"decode (batch {result['decode']['batch']})", **result["decode"]}]
    for row in rows:
        row["share"] = f"{100 * row['share_of_peak']:.1f}%"
        if "gbytes_per_s" in row:
            row["bytes"] = f"{row['gbytes_per_s']:.1f} GB/s"
            row["bandwidth_share"] = f"{100 * row['share_of_bandwidth']:.1f}%"
    return "\n".join([
        f"model {result['model']}, dtype {result['dtype']}, {result['num_threads']} threads, "
        f"allocator {result['machine']['allocator']}",
        f"cpu {result['machine']['cpu']}, features: "
        f"{' '.join(result['machine']['features']) or 'none detected'}",
        f"measured matmul peak (GFLOP/s): {peaks}; read bandwidth "
        f"{result['read_gbytes_per_s']:.1f} GB/s",
        format_table(rows, [("phase", "phase"), ("tokens_per_s", "tok/s"),
                            ("gflops", "GFLOP/s"), ("share", f"of {result['dtype']} peak"),
                            ("bytes", "bytes read"), ("bandwidth_share", "of bandwidth")]),
        common.busy_warning(result["machine"]) or ""]).rstrip()


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(report(result))
    if args.output_json:
        write_json(args.output_json, result)
    if args.plot:
        from runtime.bench.plot import plot_compute
        plot_compute(result, args.plot)
    return 0
