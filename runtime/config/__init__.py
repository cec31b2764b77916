"""Engine configuration: what the user chose, and what follows from the model."""
from __future__ import annotations

import os
import re
from dataclasses import Field, dataclass, field, fields
from typing import Any, Callable

import torch

from runtime.attention_backends.base import KV_CACHE_DTYPES
from runtime.config.kv_transfer import KVTransferConfig, offloading_config
from runtime.config.speculative import SpeculativeConfig
from runtime.config.structured_outputs import StructuredOutputsConfig

_DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DTYPE_NAMES = tuple(_DTYPES)
SCHEDULING_POLICIES = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("uniproc", "mp", "ray")
MAX_LOGPROBS = 20  # the most alternatives `logprobs` / `prompt_logprobs` may ask for (as OpenAI)
MODEL_IMPLS = ("auto", "native", "transformers")  # see runtime.models.registry
RUNNERS = ("auto", "generate", "pooling")  # see runtime.pooling.models
MAMBA_CACHE_MODES = ("all", "none")  # see docs/hybrid.md
# vLLM's names for what we call otherwise; `LLM(...)` and the flags accept both.
KEYWORD_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}
EXECUTOR_BACKEND_ALIASES = {"uni": "uniproc"}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """`--dtype` as a torch dtype; None means the platform's default."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {value!r}")
    return _DTYPES[value]


def parse_size(value: int | str | None, name: str = "kv_cache_memory") -> int | None:
    """A byte or token count from an int or a string, as vLLM reads them: '4GiB', '4Gi', '4G'
    and '512MB' are binary (x1024), a lowercase unit alone is decimal ('32k' = 32000)."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(?:([kmgtKMGT])(i?)[bB]?)?\s*", value)
    if match is None:
        raise ValueError(f"{name} must be a count or a size like '4GiB' or '32k', got {value!r}")
    number, unit, binary = match.groups()
    if unit is None:
        return int(float(number))
    power = "kmgt".index(unit.lower()) + 1
    base = 1024 if unit.isupper() or binary else 1000
    return int(float(number) * base ** power)


ENGINE = "engine"
LORA = "LoRA adapters (see docs/lora.md)"
PARALLEL = "parallelism (see docs/distributed.md)"
KV_TRANSFER = "KV connectors and offloading (see docs/kv_connectors.md)"


@dataclass(frozen=True)
class Flag:
    """How an `EngineConfig` field appears on the command line; runtime.cli.engine_args builds
    every engine flag from these, so a field, its default and its flag are declared once.

    The flag is `--field-name` (an int, float or str value, a str for a None default unless
    `type` says otherwise; a bool is `--x/--no-x`, or `--x` alone with `store_true`), then
    `aliases` (vLLM's spellings, short forms), and `negations`, extra flags that set a bool
    False.
    """

    help: str = ""
    aliases: tuple[str, ...] = ()
    negations: tuple[str, ...] = ()
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    store_true: bool = False
    group: str = ENGINE


def option(default: Any, help: str = "", *, cli: bool = True, **flag: Any) -> Any:
    """An `EngineConfig` field with its flag (`cli=False`: set by the engine, not a user)."""
    return field(default=default, metadata={"flag": Flag(help, **flag) if cli else None})


def flag_of(f: Field) -> Flag | None:
    return f.metadata.get("flag")


@dataclass
class EngineConfig:
    """Everything the engine needs to start; `LLM(**kwargs)` and the CLI flags map onto it."""

    model: str | None = option(
        None, "a Hugging Face folder, a model id in the local Hugging Face cache, or a .gguf "
              "file (default: the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = option(None, "tokenizer folder, if not the model's")
    model_impl: str = option(
        "auto", "native: our model classes; transformers: the transformers fallback; auto: "
                "native when the architecture has a class (default)", choices=MODEL_IMPLS)
    runner: str = option(
        "auto", "pooling: embeddings, scoring and classification (/v1/embeddings, /score, "
                "/rerank, /classify); auto: pooling for sentence-transformers folders, encoders "
                "and *ForSequenceClassification (default)", choices=RUNNERS)
    device: str | None = option(
        None, "force a platform by name (default: RUNTIME_DEVICE, else detection)")
    # after __post_init__ a torch dtype, or None for the platform's default
    dtype: torch.dtype | str | None = option(
        "auto", "default: auto, the platform's native choice", choices=DTYPE_NAMES)
    kv_cache_memory: int | str | None = option(
        None, "bytes for the KV cache, e.g. 4GiB or 4294967296 (default: a safe share of "
              "memory); more than the device has free is refused",
        aliases=("--kv-cache-memory-bytes",), type=parse_size)
    kv_cache_dtype: str = option(
        "auto", "auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: one byte per element, "
                "scaled per layer (see docs/kv_cache.md)", choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = option(
        False, "FP8 KV cache: per-layer k/v scales from the first batch instead of the "
               "checkpoint's (default 1.0)")
    gpu_memory_utilization: float = option(
        0.9, "accelerators: share of device memory for weights, activations and KV cache "
             "together (default: 0.9)")
    block_size: int = option(16, "tokens per KV-cache block")
    max_num_seqs: int = option(256, "the most sequences in one step's batch")
    max_num_batched_tokens: int = option(2048, "the token budget of one step")
    max_num_encoder_input_tokens: int | None = option(
        None, "the encoder's budget of one step, in multimodal embedding tokens "
        "(default: --max-num-batched-tokens)", type=int)
    encoder_cache_size: int | None = option(
        None, "multimodal embedding tokens the encoder cache keeps, shared between requests "
        "with the same item (default: --max-num-batched-tokens)", type=int)
    limit_mm_per_prompt: dict | str | None = option(
        None, "the most multimodal items of each modality one prompt may hold, as JSON: "
        "'{\"image\": 4}' (default: 999 images)", type=str)
    allowed_media_domains: list[str] | str | None = option(
        None, "hosts image URLs may be fetched from over http(s), comma-separated (subdomains "
        "included; default: none, only data: URLs)", type=str)
    allowed_local_media_path: str | None = option(
        None, "the folder file:// image URLs may read from (default: none)")
    max_model_len: int | str | None = option(
        None, "context length in tokens, e.g. 2048 or 2k (default: the model's)",
        type=parse_size)
    enable_prefix_caching: bool = option(
        True, "reuse the KV blocks of shared prompt prefixes", negations=("--no-prefix-caching",))
    mamba_cache_mode: str = option(
        "all", "hybrid models' prefix caching: all: checkpoint the recurrent state at the end "
               "of full blocks (every --mamba-checkpoint-interval blocks, and each prompt's "
               "last), so a prefix hit resumes there; none: keep no checkpoints, so a hybrid's "
               "prefix never hits (see docs/hybrid.md)", choices=MAMBA_CACHE_MODES)
    mamba_checkpoint_interval: int = option(
        1, "hybrid models: checkpoint the recurrent state every this many blocks (default 1: "
           "every block, the dense model's hit granularity; more: less host memory and copying "
           "for shallower hits)")
    mamba_checkpoint_memory: int | str = option(
        1 << 30, "hybrid models: host memory for recurrent-state checkpoints, e.g. 512MiB; the "
                "least recently used go first when it is full (default: 1GiB)",
        type=parse_size)
    enable_chunked_prefill: bool = option(
        True, "split long prompts over steps, beside running decodes",
        negations=("--no-chunked-prefill",))
    max_num_partial_prefills: int = option(
        1, "chunked prefill: how many prompts may be part-way through their prefill at once; "
           "above 1 each step shares its budget between them, so that one long prompt does not "
           "hold back the others (default: 1)")
    max_long_partial_prefills: int = option(
        1, "chunked prefill: of those, how many may be long (see "
           "--long-prefill-token-threshold); a long prompt beyond it waits, and shorter ones "
           "behind it go first (default: 1)")
    long_prefill_token_threshold: int = option(
        0, "chunked prefill: a prompt with more tokens than this left to compute is long "
           "(default 0: 4%% of max_model_len when --max-num-partial-prefills > 1)")
    scheduling_policy: str = option("fcfs", "the waiting queue's order",
                                    choices=SCHEDULING_POLICIES)
    attention_backend: str | None = option(None, "force an attention backend")
    enforce_eager: bool = option(False, "never compile or capture graphs")
    num_threads: int | None = option(None, "host threads for the model", type=int)
    seed: int = option(0, "the seed of the engine's random state")
    revision: str | None = option(
        None, "with a model id (org/name): the branch, tag or commit to take from the local "
              "Hugging Face cache (nothing is downloaded)")
    download_dir: str | None = option(
        None, "with a model id: the Hugging Face cache folder to look in (default: "
              "HF_HUB_CACHE, ~/.cache/huggingface/hub)")
    trust_remote_code: bool = option(
        False, "let a model folder's own Python code define its config and tokenizer")
    max_logprobs: int = option(
        MAX_LOGPROBS, "the most logprobs or prompt_logprobs a request may ask for")
    enable_prompt_embeds: bool = option(
        False, "accept prompts given as embeddings (prompt_embeds: a [tokens, hidden size] "
               "tensor) in place of token ids")
    enable_mm_embeds: bool = option(
        False, "accept images given as their embeddings (image_embeds: a [tokens, hidden "
               "size] tensor, Qwen-VL with its image_grid_thw) in place of pixels")
    generation_config: str = option(
        "auto", "'auto': sampling defaults (temperature, top_p, top_k, repetition_penalty, "
                "max_new_tokens) from the model's generation_config.json; 'vllm': none, "
                "SamplingParams' own; or a folder holding a generation_config.json "
                "(default: auto)")
    engine_stall_timeout: float = option(
        60.0, "seconds a server's engine core with requests in flight may go without stepping "
              "before it counts as dead: it is killed and restarted, and its requests go on "
              "on the new core (0: no watchdog)")
    enable_sleep_mode: bool = option(
        False, "allow sleep(level) / the server's /sleep: free the KV cache (level 1), and the "
               "weights too (level 2, read again from the model on wake-up) until woken (see "
               "docs/sleep.md)", store_true=True)
    disable_log_stats: bool = option(
        False, "no periodic throughput and KV-cache usage lines in the log", store_true=True)
    quantization: str | None = option(
        None, "quantization method: int8 | int4 | fp8 (at load) | gguf (a .gguf kept "
              "quantized) | gptq | awq | mxfp4 | nvfp4 (read from the checkpoint), with options "
              "as NAME:key=value,... (default: the checkpoint's own, else none; `runtime "
              "plugins` lists them)", aliases=("-q",))
    # speculative decoding: a SpeculativeConfig, or its dict / JSON text; None: off
    speculative_config: SpeculativeConfig | dict | str | None = option(
        None, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_max": 4, "prompt_lookup_min": 1} or {"method": "draft_model", '
              '"model": PATH, "num_speculative_tokens": 4} (see docs/speculative.md)')
    # structured outputs: a StructuredOutputsConfig, or its dict / JSON text; None: defaults
    structured_outputs_config: StructuredOutputsConfig | dict | str | None = option(
        None, 'structured outputs, as JSON: {"backend": "auto" | "xgrammar" | "guidance"} '
              '(auto: xgrammar; guidance: llguidance; see docs/structured_outputs.md)')
    # KV connectors (runtime.kv_transfer): a KVTransferConfig, or its dict / JSON text; None: off
    kv_transfer_config: KVTransferConfig | dict | str | None = option(
        None, 'a KV connector, as JSON: {"kv_connector": NAME, "kv_role": "kv_both", '
              '"kv_connector_extra_config": {...}} (`runtime plugins` lists the connectors)',
        group=KV_TRANSFER)
    kv_offloading_size: float | None = option(
        None, "GiB of host memory for blocks evicted from the prefix cache (the "
              "OffloadingConnector); a hit loads them back", type=float, group=KV_TRANSFER)
    kv_offloading_disk_path: str | None = option(
        None, "a folder for the offload tier's disk level: blocks leaving host memory go there, "
              "and the prefix cache survives a restart", group=KV_TRANSFER)
    kv_offloading_disk_size: float | None = option(
        None, "GiB the disk level may hold (default 16)", type=float, group=KV_TRANSFER)
    # multi-LoRA (runtime.lora): adapters in max_loras device slots, max_cpu_loras in host memory
    enable_lora: bool = option(
        False, "serve PEFT LoRA adapters on top of the model, mixed in one batch",
        store_true=True, group=LORA)
    max_loras: int = option(1, "adapters one step may use (device slots)", group=LORA)
    max_lora_rank: int = option(16, "the largest adapter rank", group=LORA)
    max_cpu_loras: int | None = option(
        None, "adapters kept read in host memory, least recently used dropped (default: "
              "--max-loras)", type=int, group=LORA)
    tensor_parallel_size: int = option(
        1, "ranks that split every layer (heads, MLP columns, vocabulary)", aliases=("-tp",),
        group=PARALLEL)
    pipeline_parallel_size: int = option(
        1, "ranks that each run a consecutive share of the layers", aliases=("-pp",),
        group=PARALLEL)
    enable_expert_parallel: bool = option(
        False, "MoE layers: each tensor-parallel rank holds num_experts / tp whole experts "
               "instead of a slice of every expert", aliases=("-ep",), group=PARALLEL)
    decode_context_parallel_size: int = option(
        1, "ranks of each tensor-parallel group that split every sequence's KV tokens between "
           "them instead of each holding a copy of the same KV heads (divides "
           "--tensor-parallel-size): the KV cache holds this many times the tokens",
        aliases=("-dcp",), group=PARALLEL)
    cp_kv_cache_interleave_size: int = option(
        1, "decode context parallel deals each sequence's tokens to the ranks in runs of this "
           "many positions (divides --block-size)", group=PARALLEL)
    data_parallel_size: int = option(
        1, "engine replicas behind the server, each with tp x pp ranks", aliases=("-dp",),
        group=PARALLEL)
    # set by the server for each replica: which of the data_parallel_size_local replicas on this
    # host a core is (the host's cores are shared out between all their ranks)
    data_parallel_rank: int = option(0, cli=False)
    data_parallel_size_local: int = option(1, cli=False)
    distributed_executor_backend: str | None = option(
        None, "how ranks run: in this process (uniproc), one process per rank on this machine "
              "(mp), or Ray actors (ray); 'uni' is vLLM's name for uniproc (default: uniproc "
              "for one rank, else mp)",
        choices=EXECUTOR_BACKENDS + tuple(EXECUTOR_BACKEND_ALIASES), group=PARALLEL)
    ray_address: str | None = option(
        None, "an existing Ray cluster for --distributed-executor-backend ray (default: "
              "RAY_ADDRESS, else a new local Ray instance)", group=PARALLEL)

    def _check_kv_transfer(self) -> None:
        if not self.enable_prefix_caching:
            raise ValueError("a KV connector moves prefix-cache blocks: it needs prefix caching "
                             "(drop --no-prefix-caching)")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            raise ValueError("a KV connector moves the target model's KV only: the draft "
                             "model's would be missing for loaded blocks; use the ngram method")
        if self.calculate_kv_scales and \
                self.kv_transfer_config.kv_connector_extra_config.get("disk_path"):
            raise ValueError("--calculate-kv-scales sets new FP8 scales at each start, so blocks "
                             "saved to disk by an earlier start would be read with other scales")

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        offloading = offloading_config(self.kv_offloading_size, self.kv_offloading_disk_path,
                                       self.kv_offloading_disk_size)
        if offloading is not None:
            if self.kv_transfer_config is not None:
                raise ValueError("--kv-offloading-size / --kv-offloading-disk-path set their own "
                                 "kv_transfer_config: pass one or the other")
            self.kv_transfer_config = offloading
        if self.kv_transfer_config is not None:
            self._check_kv_transfer()
        self.structured_outputs_config = StructuredOutputsConfig.parse(
            self.structured_outputs_config)
        if self.speculative_config is not None and self.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding needs pipeline_parallel_size 1, got "
                             f"{self.pipeline_parallel_size}")
        self.dtype = parse_dtype(self.dtype)
        self.kv_cache_memory = parse_size(self.kv_cache_memory, "kv_cache_memory")
        self.mamba_checkpoint_memory = parse_size(self.mamba_checkpoint_memory,
                                                  "mamba_checkpoint_memory")
        self.max_model_len = parse_size(self.max_model_len, "max_model_len")
        if self.device is None:
            self.device = os.environ.get("RUNTIME_DEVICE") or None
        for name in ("model_impl", "runner", "kv_cache_dtype", "scheduling_policy",
                     "mamba_cache_mode"):
            choices = flag_of(self.__dataclass_fields__[name]).choices
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, "
                                 f"got {getattr(self, name)!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        backend = self.distributed_executor_backend = EXECUTOR_BACKEND_ALIASES.get(
            self.distributed_executor_backend, self.distributed_executor_backend)
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {backend!r}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the most the "
                             f"sampler returns), got {self.max_logprobs}")
        if self.engine_stall_timeout < 0:
            raise ValueError("engine_stall_timeout must be >= 0 (0: no watchdog), got "
                             f"{self.engine_stall_timeout}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.enable_lora:  # a captured graph would not see each step's adapter slots
            self.enforce_eager = True
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        for name in ("max_loras", "max_lora_rank", "block_size", "max_num_seqs",
                     "max_num_batched_tokens", "max_num_partial_prefills",
                     "max_long_partial_prefills", "mamba_checkpoint_interval",
                     "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_partial_prefills()
        self._check_decode_context_parallel()
        self._resolve_multimodal()

    def _check_decode_context_parallel(self) -> None:
        dcp, tp, interleave = (self.decode_context_parallel_size, self.tensor_parallel_size,
                               self.cp_kv_cache_interleave_size)
        if dcp < 1 or tp % dcp:
            allowed = [n for n in range(1, tp + 1) if tp % n == 0]
            raise ValueError(f"decode_context_parallel_size {dcp} must divide "
                             f"tensor_parallel_size {tp} (its groups are tensor-parallel "
                             f"ranks); allowed: {allowed}")
        if interleave < 1 or self.block_size % interleave:
            raise ValueError(f"cp_kv_cache_interleave_size {interleave} must divide "
                             f"block_size {self.block_size}")
        if dcp == 1:
            return
        if self.speculative_config is not None:
            raise ValueError("decode context parallel does not run speculative decoding: "
                             "verifying proposals and the draft model's own KV would need "
                             "their sharded cache too")
        if self.kv_transfer_config is not None:
            raise ValueError("decode context parallel does not run with a KV connector: "
                             "connectors move whole blocks of one rank, while each rank holds "
                             "only its share of every block")

    def _resolve_multimodal(self) -> None:
        """The encoder's budget and cache default to the step's budget; the per-prompt limits
        are parsed from JSON, a mapping of modality to a count >= 0."""
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) is None:
                setattr(self, name, self.max_num_batched_tokens)
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        limits = self.limit_mm_per_prompt
        if isinstance(limits, str):
            import json
            try:
                limits = json.loads(limits)
            except json.JSONDecodeError as e:
                raise ValueError(f"limit_mm_per_prompt must be JSON such as '{{\"image\": 4}}', "
                                 f"got {limits!r} ({e})") from None
        if limits is not None and (not isinstance(limits, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in limits.items())):
            raise ValueError(f"limit_mm_per_prompt maps a modality to a count >= 0, such as "
                             f"{{\"image\": 4}}; got {limits!r}")
        self.limit_mm_per_prompt = limits
        domains = self.allowed_media_domains
        if isinstance(domains, str):
            domains = [d.strip().lower() for d in domains.split(",") if d.strip()]
        self.allowed_media_domains = list(domains or [])

    def _check_partial_prefills(self) -> None:
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills ({self.max_long_partial_prefills}) "
                             f"must be <= max_num_partial_prefills "
                             f"({self.max_num_partial_prefills})")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, "
                             f"got {self.long_prefill_token_threshold}")
        if self.max_num_partial_prefills > 1 and not self.enable_chunked_prefill:
            raise ValueError("max_num_partial_prefills > 1 shares a step between prompt chunks: "
                             "it needs enable_chunked_prefill")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        for alias, name in KEYWORD_ALIASES.items():
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"give {alias} or {name}, not both")
                kwargs[name] = kwargs.pop(alias)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str, **overrides: Any) -> "EngineConfig":
        """Fields from a YAML file of options (as `runtime tune` writes), with `overrides`
        (e.g. the caller's explicit keywords) on top."""
        return cls.from_kwargs(**{**load_options_file(path), **overrides})


def load_options_file(path: str) -> dict[str, Any]:
    """A YAML file of options (`max_num_seqs: 64`; `max-num-seqs` alike), as a dict with
    underscored names: the one reader of `LLM(config=...)` and `runtime serve --config`."""
    import yaml
    with open(path, encoding="utf-8") as f:
        try:
            loaded = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            detail = " ".join(str(e).split())  # one line
            raise ValueError(f"{path} is not valid YAML: {detail}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} must map option names to values, "
                         f"got a {type(loaded).__name__}")
    return {str(k).replace("-", "_"): v for k, v in loaded.items()}
