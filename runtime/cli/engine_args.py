"""Engine options as command-line flags, shared by every subcommand that starts an engine."""
from __future__ import annotations

import argparse
from typing import Any

from runtime.attention_backends.base import KV_CACHE_DTYPES
from runtime.config import (DTYPE_NAMES, EXECUTOR_BACKEND_ALIASES, EXECUTOR_BACKENDS,
                            SCHEDULING_POLICIES, parse_size)
from runtime.models.registry import MODEL_IMPLS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a Hugging Face folder or a .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
    g.add_argument("--model-impl", choices=MODEL_IMPLS, default="auto",
                   help="native: our model classes; transformers: the transformers fallback; "
                        "auto: native when the architecture has a class (default)")
    g.add_argument("--runner", choices=("auto", "generate", "pooling"), default="auto",
                   help="pooling: embeddings, scoring and classification (/v1/embeddings, "
                        "/score, /rerank, /classify); auto: pooling for sentence-transformers "
                        "folders, encoders and *ForSequenceClassification (default)")
    g.add_argument("--device", default=None,
                   help="force a platform by name (default: RUNTIME_DEVICE, else detection)")
    g.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help="default: auto, the platform's native choice")
    g.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", dest="kv_cache_memory",
                   default=None, type=parse_size,
                   help="bytes for the KV cache, e.g. 4GiB or 4294967296 (default: a safe "
                        "share of memory); more than the device has free is refused")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: one byte per "
                        "element, scaled per layer (see docs/kv_cache.md)")
    g.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=False,
                   help="FP8 KV cache: per-layer k/v scales from the first batch instead of the "
                        "checkpoint's (default 1.0)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="accelerators: share of device memory for weights, activations and "
                        "KV cache together (default: 0.9)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=parse_size, default=None,
                   help="context length in tokens, e.g. 2048 or 2k (default: the model's)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV blocks of shared prompt prefixes")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="same as --no-enable-prefix-caching")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="split long prompts over steps, beside running decodes")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   help="same as --no-enable-chunked-prefill")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs")
    g.add_argument("--attention-backend", default=None, help="force an attention backend")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="never compile or capture graphs")
    g.add_argument("--num-threads", type=int, default=None, help="host threads for the model")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--revision", default=None,
                   help="with a model id (org/name): the branch, tag or commit to take from the "
                        "local Hugging Face cache (nothing is downloaded)")
    g.add_argument("--download-dir", default=None,
                   help="with a model id: the Hugging Face cache folder to look in "
                        "(default: HF_HUB_CACHE, ~/.cache/huggingface/hub)")
    g.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False,
                   help="let a model folder's own Python code define its config and tokenizer")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs or prompt_logprobs a request may ask for")
    g.add_argument("--generation-config", default="auto",
                   help="'auto': sampling defaults (temperature, top_p, top_k, "
                        "repetition_penalty, max_new_tokens) from the model's "
                        "generation_config.json; 'vllm': none, SamplingParams' own; or a folder "
                        "holding a generation_config.json (default: auto)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput and KV-cache usage lines in the log")
    g.add_argument("--quantization", "-q", default=None,
                   help="quantization method: int8 | int4 | fp8 (at load) | gguf (a .gguf "
                        "kept quantized) | gptq | awq | mxfp4 | nvfp4 (read from the checkpoint), "
                        "with options as NAME:key=value,... (default: the checkpoint's own, "
                        "else none; `runtime plugins` lists them)")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding, as JSON: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 1} or {"method": "draft_model", "model": PATH, '
                        '"num_speculative_tokens": 4} (see docs/speculative.md)')
    g.add_argument("--structured-outputs-config", default=None,
                   help='structured outputs, as JSON: {"backend": "auto" | "xgrammar" | '
                        '"guidance"} (auto: xgrammar; guidance: llguidance; see '
                        'docs/structured_outputs.md)')
    g = parser.add_argument_group("LoRA adapters (see docs/lora.md)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters on top of the model, mixed in one batch")
    g.add_argument("--max-loras", type=int, default=1,
                   help="adapters one step may use (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept read in host memory, least recently used dropped "
                        "(default: --max-loras)")
    g = parser.add_argument_group("parallelism (see docs/distributed.md)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks that split every layer (heads, MLP columns, vocabulary)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="ranks that each run a consecutive share of the layers")
    g.add_argument("--enable-expert-parallel", "-ep", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="MoE layers: each tensor-parallel rank holds num_experts / tp whole "
                        "experts instead of a slice of every expert")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind the server, each with tp x pp ranks")
    g.add_argument("--distributed-executor-backend", default=None,
                   choices=EXECUTOR_BACKENDS + tuple(EXECUTOR_BACKEND_ALIASES),
                   help="how ranks run: in this process (uniproc), one process per rank on "
                        "this machine (mp), or Ray actors (ray); 'uni' is vLLM's name for "
                        "uniproc (default: uniproc for one "
                        "rank, else mp)")
    g.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster for --distributed-executor-backend ray "
                        "(default: RAY_ADDRESS, else a new local Ray instance)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = ("model", "tokenizer", "model_impl", "runner", "device", "dtype", "kv_cache_memory",
             "kv_cache_dtype", "calculate_kv_scales",
             "gpu_memory_utilization", "block_size",
             "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
             "enable_chunked_prefill", "scheduling_policy", "attention_backend", "enforce_eager",
             "num_threads", "seed", "revision", "download_dir", "trust_remote_code", "max_logprobs",
             "generation_config", "disable_log_stats", "quantization", "speculative_config",
             "structured_outputs_config",
             "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
             "tensor_parallel_size",
             "pipeline_parallel_size", "enable_expert_parallel", "data_parallel_size",
             "distributed_executor_backend", "ray_address")
    return {name: getattr(args, name) for name in names}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "sampling", "a flag left out takes the model's generation config (--generation-config), "
        "else SamplingParams' default")
    g.add_argument("--max-tokens", type=int, default=None, help="default: 256")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def sampling_kwargs(args: argparse.Namespace, defaults: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keywords: the flags given, over `defaults` (the generation config's)."""
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature,
             "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
             "repetition_penalty": args.repetition_penalty, "seed": args.sampling_seed,
             "stop": args.stop}
    merged = {"max_tokens": 256, **defaults}
    merged.update({k: v for k, v in given.items() if v is not None})
    return merged
