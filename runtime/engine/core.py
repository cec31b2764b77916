"""The engine core: schedule, execute, update — one step at a time."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import torch

from runtime.attention_backends.base import kv_cache_torch_dtype
from runtime.plugins.interfaces import Platform
from runtime.config import EngineConfig
from runtime.core.kv_cache_manager import KVCacheManager
from runtime.core.scheduler import Scheduler
from runtime.core.step_input import StepInputBuilder
from runtime.engine.step_stats import StepTokens
from runtime.executor import build_executor
from runtime.model_config import ModelConfig
from runtime.model_loader.source import ModelSource
from runtime.pooling.models import is_encoder_only
from runtime.request import Request, RequestStatus
from runtime.core.structured_output import StructuredOutputManager
from runtime.core.messages import TokenLogprobs

logger = logging.getLogger(__name__)


class PooledTensor(msgspec.Struct, array_like=True):
    """A pooling request's result as it crosses to the API process: float32, native order."""

    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "PooledTensor":
        return cls(list(tensor.shape), tensor.float().contiguous().numpy().tobytes())

    def tensor(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.data), dtype=torch.float32).view(self.shape)


@dataclass
class CoreOutput:
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # time.monotonic() when it was first scheduled (the host's one clock, so the API process
    # compares it with its own for the queue and prefill times)
    first_scheduled_time: float | None = None
    pooling_output: PooledTensor | None = None  # a pooling request's result, when it finishes


class EngineCore:
    def __init__(self, config: EngineConfig, platform: Platform, source: ModelSource,
                 model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size {config.data_parallel_size} runs engine "
                             "replicas behind the server (runtime serve --data-parallel-size "
                             "N); one engine core, like the offline LLM, is one replica")
        self.source = source
        # An encoder's pooling requests keep no KV: one block, never handed out, keeps the
        # block pool well-formed.
        self.encoder_only = is_encoder_only(config, model_config)  # refuses what pooling lacks
        self.executor = build_executor(config, platform, source, model_config)
        num_blocks = 1 if self.encoder_only else self.executor.determine_num_blocks()
        if num_blocks < 1:
            raise ValueError("the KV-cache budget holds no block: raise --kv-cache-memory")
        self.executor.init_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        per_block = model_config.kv_bytes_per_block(
            config.block_size, kv_cache_torch_dtype(config.kv_cache_dtype, model_config.dtype),
            config.tensor_parallel_size)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB per tensor-parallel "
                    "rank over all stages; %d bytes per token%s)", num_blocks,
                    config.block_size, num_blocks * config.block_size,
                    num_blocks * per_block / 2**20, per_block // config.block_size,
                    ", one MLA latent per layer" if model_config.attention_kind == "mla" else "")
        if not self.encoder_only:
            self._fit_max_model_len(num_blocks * config.block_size, "the KV cache",
                                    "raise --kv-cache-memory")
            if not config.enable_chunked_prefill:  # a longer prompt would wait forever
                self._fit_max_model_len(config.max_num_batched_tokens,
                                        "one step without chunked prefill",
                                        "raise --max-num-batched-tokens")
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, model_config.max_model_len,
                                   self.encoder_only)
        spec = config.speculative_config
        self.step_inputs = StepInputBuilder(self.kv, model_config.max_model_len,
                                            spec is not None and spec.needs_lookahead)
        # constrained requests' grammars and matchers; the grammar backend (xgrammar takes
        # seconds to import) is made on the first request with structured_outputs
        self.structured = StructuredOutputManager(self._grammar_compiler)
        # the requests the last step ended with an error (finish_reason "abort"), with it
        self.failed: list[tuple[Request, str]] = []
        self.step_tokens = StepTokens()  # tokens scheduled per step, for /metrics

    def _fit_max_model_len(self, tokens: int, where: str, fix: str) -> None:
        """Every request must fit the cache alone, or preemption could never make room for it;
        without chunked prefill, its whole prompt (or recompute) must fit one step's budget.
        A model's own length is lowered to fit; one the user set is refused."""
        mc = self.model_config
        if mc.max_model_len <= tokens:
            return
        if self.config.max_model_len is not None:
            raise ValueError(f"max_model_len {mc.max_model_len} is more than the {tokens} "
                             f"tokens that fit {where}: {fix} or lower --max-model-len")
        logger.warning("max_model_len lowered from %d to %d tokens to fit %s",
                       mc.max_model_len, tokens, where)
        mc.max_model_len = tokens

    def check_health(self) -> None:
        """Raise if a worker is gone (the executor's WorkerError)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()

    def add_request(self, request: Request) -> None:
        """Queue a request; one with structured_outputs first waits for its grammar."""
        if request.params.structured_outputs is None:
            self.scheduler.add_request(request)
        else:
            self.structured.add_request(request)

    def _grammar_compiler(self):
        from runtime.engine.input_processor import eos_token_ids
        from runtime.model_loader.source import load_tokenizer
        from runtime.structured_output.backends import make_compiler
        tokenizer = load_tokenizer(self.source, self.config.trust_remote_code)
        return make_compiler(self.config.structured_outputs_config.resolved_backend, tokenizer,
                             self.model_config.vocab_size, eos_token_ids(
                                 self.source, self.model_config.hf_config, tokenizer))

    def _admit_compiled(self) -> list[CoreOutput]:
        """Hand the requests whose grammar is ready to the scheduler; the outputs that end
        those whose grammar failed to compile (the API process checked it, so it is rare)."""
        ready, failed = self.structured.take_ready()
        for request in ready:
            self.scheduler.add_request(request)
        for request, error in failed:
            logger.error("request %s: its grammar failed to compile: %s", request.request_id,
                         error)
            request.status = RequestStatus.FINISHED_ABORTED
            request.stop_reason = f"its grammar failed to compile: {error}"
            self.failed.append((request, request.stop_reason))
        return [CoreOutput(r.request_id, [], finish_reason=r.status.finish_reason,
                           stop_reason=r.stop_reason) for r, _ in failed]

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> None:
        """End a request early (a stop string matched, or the caller aborted it)."""
        self.structured.drop(request_id)
        if self.scheduler.finish_request(request_id, status, stop_reason) is not None:
            self.step_inputs.finished([request_id])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.structured.waiting)

    def step(self) -> list[CoreOutput]:
        self.failed.clear()
        outputs = self._admit_compiled()
        sched = self.scheduler.schedule()
        self.step_inputs.preempted(sched.preempted)
        if sched.is_empty:
            if not outputs:
                self.structured.wait(timeout=0.05)  # nothing runs until a grammar is ready
            return outputs
        self.step_tokens.add(sched.num_batched_tokens)
        step_input = self.step_inputs.build(sched)
        step_input.grammar_bitmask, step_input.grammar_rows = \
            self.structured.bitmask(sched.scheduled)
        result = self.executor.execute(step_input)
        refused = dict(result.failed)  # e.g. a LoRA adapter that could not be read
        # a sampled token the grammar refuses ends its request
        refused.update(self.structured.accept(sched.scheduled, result.sampled))
        finished = self.scheduler.update(sched, result.sampled, result.draft_token_ids)
        for request_id, error in refused.items():
            logger.error("request %s: %s", request_id, error)
            request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED,
                                                    error)
            if request is not None:
                finished.append(request)
                self.failed.append((request, error))
        self.step_inputs.finished(r.request_id for r in finished)
        self.structured.advance(sched.scheduled)
        for r, _ in sched.scheduled:
            new = result.sampled.get(r.request_id, [])
            plp = result.prompt_logprobs.get(r.request_id)
            pooled = result.pooled.get(r.request_id)
            if not new and plp is None and pooled is None and r.request_id not in refused:
                continue
            outputs.append(CoreOutput(
                request_id=r.request_id, new_token_ids=new,
                logprobs=result.logprobs.get(r.request_id), prompt_logprobs=plp,
                finish_reason=r.status.finish_reason, stop_reason=r.stop_reason,
                num_cached_tokens=r.num_cached_tokens,
                first_scheduled_time=r.first_scheduled_time,
                pooling_output=None if pooled is None else PooledTensor.of(pooled)))
        return outputs
