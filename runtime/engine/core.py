"""The engine core: schedule, execute, update — one step at a time."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

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
from runtime.executor.base import WorkerError
from runtime.kv_transfer.registry import build_scheduler_side
from runtime.model_config import ModelConfig
from runtime.model_loader.source import ModelSource, load_config, resolve_model
from runtime.plugins.kv_connector import KVConnectorOutput
from runtime.pooling.models import is_encoder_only
from runtime.request import Request, RequestStatus
from runtime.core.structured_output import StructuredOutputManager
from runtime.core.messages import StepInput, TokenLogprobs

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")  # what wake_up can bring back, in the order it does
# config fields a new checkpoint may change (its weights must fit the model as it is built)
FREE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype",
                              "_commit_hash", "_attn_implementation_autoset"})


class EngineBusyError(RuntimeError):
    """Sleep or a weight reload was asked while requests are in flight."""


def config_differences(old: Any, new: Any) -> list[str]:
    """The config keys in which checkpoint `new` differs from the `old` one it is to replace
    (beyond names, versions and the stored dtype)."""
    a, b = old.to_dict(), new.to_dict()
    return sorted(k for k in set(a) | set(b) if k not in FREE_CONFIG_KEYS and a.get(k) != b.get(k))


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
    # what the KV connector says another instance needs to find this request's KV (when it
    # finishes)
    kv_transfer_params: dict | None = None


def refuse_for_hybrid(config: EngineConfig, architecture: str) -> None:
    """What a hybrid model (recurrent layers beside attention) cannot run with, named."""
    why = f"{architecture} has recurrent layers"
    if config.speculative_config is not None:
        raise ValueError(f"speculative decoding is not supported for {why}: their state "
                         "cannot be rolled back past rejected proposals (it is not "
                         "checkpointed per proposed position)")
    if config.enable_lora:
        raise ValueError(f"--enable-lora is not supported for {why}: adapters are not "
                         "applied to the recurrent layers' projections")
    if config.runner == "pooling":
        raise ValueError(f"the pooling runner is not supported for {why}: pooling steps "
                         "do not carry recurrent state slots")
    if config.kv_transfer_config is not None:
        raise ValueError(f"a KV connector is not supported for {why}: it moves prefix-cache "
                         "blocks without the recurrent state checkpointed at their ends")


def refuse_for_prompt_embeds(config: EngineConfig, model_config: ModelConfig) -> None:
    """What --enable-prompt-embeds cannot run with, named."""
    name = model_config.architecture
    if not getattr(model_config.choice.model_class, "supports_prompt_embeds", False):
        raise ValueError(f"--enable-prompt-embeds is not supported for {name} "
                         f"({model_config.choice.impl}): its forward pass does not take "
                         "inputs_embeds in place of token ids")
    if config.runner == "pooling":
        raise ValueError("--enable-prompt-embeds is not supported with the pooling runner: "
                         "pooling steps embed their token ids")
    if config.speculative_config is not None:
        raise ValueError("--enable-prompt-embeds is not supported with speculative decoding: "
                         "the proposers read the prompt's token ids, which an embeddings "
                         "prompt does not have")


class EngineCore:
    def __init__(self, config: EngineConfig, platform: Platform, source: ModelSource,
                 model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size {config.data_parallel_size} runs engine "
                             "replicas behind the server (runtime serve --data-parallel-size "
                             "N); one engine core, like the offline LLM, is one replica")
        self.source = source  # the tokenizer's, for grammars
        self.weights_source = source  # the weights served (update_weights changes them)
        if model_config.is_hybrid:
            refuse_for_hybrid(config, model_config.architecture)
        if config.enable_prompt_embeds:
            refuse_for_prompt_embeds(config, model_config)
        # An encoder's pooling requests keep no KV: one block, never handed out, keeps the
        # block pool well-formed.
        self.encoder_only = is_encoder_only(config, model_config)  # refuses what pooling lacks
        self.executor = build_executor(config, platform, source, model_config)
        num_blocks = 1 if self.encoder_only else self.executor.determine_num_blocks()
        if num_blocks < 1:
            raise ValueError("the KV-cache budget holds no block: raise --kv-cache-memory")
        num_state_slots = config.max_num_seqs if model_config.is_hybrid else 0
        slot_bytes = self.executor.state_bytes_per_slot() if num_state_slots else 0
        # A hybrid's prefix resumes from the recurrent state checkpointed at a block's end.
        checkpointing = num_state_slots > 0 and config.enable_prefix_caching and \
            config.mamba_cache_mode == "all"
        num_checkpoints = min(config.mamba_checkpoint_memory // slot_bytes, num_blocks) \
            if checkpointing else 0
        self.executor.init_kv_cache(num_blocks, num_checkpoints)
        self.num_blocks = num_blocks
        per_block = model_config.kv_bytes_per_block(
            config.block_size, kv_cache_torch_dtype(config.kv_cache_dtype, model_config.dtype),
            config.tensor_parallel_size)
        state = ""
        if num_state_slots:
            state = (f"; recurrent state: {num_state_slots} slots of {slot_bytes / 2**20:.2f} "
                     f"MiB ({num_state_slots * slot_bytes / 2**20:.1f} MiB)")
        # decode context parallel: a block holds block_size tokens on each of the group's ranks
        dcp = config.decode_context_parallel_size
        block_tokens = config.block_size * dcp
        logger.info("KV cache: %d blocks of %d tokens (%d tokens%s, %.1f MiB per tensor-parallel "
                    "rank over all stages; %d bytes per token%s)%s", num_blocks,
                    block_tokens, num_blocks * block_tokens,
                    f" (x {dcp} with decode context parallel)" if dcp > 1 else "",
                    num_blocks * per_block / 2**20, per_block // block_tokens,
                    ", one MLA latent per layer" if model_config.attention_kind == "mla" else "",
                    state)
        if not self.encoder_only:
            self._fit_max_model_len(num_blocks * block_tokens, "the KV cache",
                                    "raise --kv-cache-memory")
            if not config.enable_chunked_prefill:  # a longer prompt would wait forever
                self._fit_max_model_len(config.max_num_batched_tokens,
                                        "one step without chunked prefill",
                                        "raise --max-num-batched-tokens")
        if checkpointing:
            logger.info("recurrent checkpoints: up to %d of %.2f MiB in host memory (%.1f MiB; "
                        "every %d blocks and each prompt's last)", num_checkpoints,
                        slot_bytes / 2**20, num_checkpoints * slot_bytes / 2**20,
                        config.mamba_checkpoint_interval)
        elif num_state_slots and config.enable_prefix_caching:
            logger.info("prefix caching off: --mamba-cache-mode none keeps no checkpoints of "
                        "%s's recurrent state", model_config.architecture)
        enable_caching = config.enable_prefix_caching and (checkpointing or not num_state_slots)
        self.kv = KVCacheManager(num_blocks, block_tokens, enable_caching, num_state_slots,
                                 num_checkpoints, config.mamba_checkpoint_interval)
        self.kv_connector = build_scheduler_side(config, model_config, source, num_blocks)
        if model_config.mm_prefix_lm:
            self._check_whole_mm_items(model_config)
        self.scheduler = Scheduler(config, self.kv, model_config.max_model_len,
                                   self.encoder_only, self.kv_connector,
                                   whole_mm_items=model_config.mm_prefix_lm)
        spec = config.speculative_config
        self.step_inputs = StepInputBuilder(self.kv, model_config.max_model_len,
                                            spec is not None and spec.needs_lookahead)
        # constrained requests' grammars and matchers; the grammar backend (xgrammar takes
        # seconds to import) is made on the first request with structured_outputs, unless
        # structured_outputs_config names it
        self.structured = StructuredOutputManager(self._grammar_compiler)
        if config.structured_outputs_config.backend != "auto":
            # a backend chosen by name will be used: build its vocabulary's tables (seconds
            # for llguidance) before serving, not beside the first constrained request's steps
            self.structured.build_compiler()
        # the requests the last step could not serve (an adapter that could not be read, a
        # grammar that failed to compile), with why: the server fails them (a request whose
        # grammar its own controls left no token ends with finish_reason "abort" instead)
        self.failed: list[tuple[Request, str]] = []
        transfer = config.kv_transfer_config
        # a request whose KV load failed fails too, instead of computing those blocks
        self.fail_failed_loads = transfer is not None and \
            transfer.kv_load_failure_policy == "fail"
        self.step_tokens = StepTokens()  # tokens scheduled per step, for /metrics
        self.asleep: set[str] = set()  # what sleep freed, of SLEEP_TAGS

    def _check_whole_mm_items(self, mc: ModelConfig) -> None:
        """A model whose image tokens attend both ways takes each image's placeholders in one
        step: the step budget must hold them."""
        tokens = mc.choice.model_class.max_tokens_per_item(mc.hf_config)
        if tokens > self.config.max_num_batched_tokens:
            raise ValueError(f"{mc.architecture} attends both ways within an image, so one "
                             f"step takes an image's {tokens} tokens whole: "
                             f"max_num_batched_tokens {self.config.max_num_batched_tokens} "
                             f"is too small (raise --max-num-batched-tokens to {tokens} or "
                             f"more)")

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
        if self.kv_connector is not None:
            self._flush_kv_connector()
            self.kv_connector.shutdown()
        self.structured.shutdown()
        self.executor.shutdown()

    def add_request(self, request: Request) -> None:
        """Queue a request; one with structured_outputs first waits for its grammar."""
        if self.asleep:
            raise ValueError("the engine is asleep: wake it up first")
        if request.params.structured_outputs is None:
            self.scheduler.add_request(request)
        else:
            self.structured.add_request(request)

    def _check_idle(self, what: str) -> None:
        if self.has_unfinished():
            n = self.scheduler.num_waiting() + len(self.scheduler.running) + \
                len(self.structured.waiting)
            raise EngineBusyError(f"{what} needs an idle engine, and {n} requests are in "
                                  "flight: let them finish or abort them first")

    def sleep(self, level: int) -> None:
        """Free the KV cache of every rank (level 1), and the weights too (level 2); the
        prefix cache is dropped. Raises EngineBusyError while requests are in flight."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True "
                             "(runtime serve --enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (free the KV cache) or 2 (the weights "
                             f"too), got {level!r}")
        self._check_idle("sleep")
        self.executor.sleep(level)
        self.kv.pool.reset_prefix_cache()
        self._new_kv_connector()
        self.asleep |= {"kv_cache", "weights"} if level == 2 else {"kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `tags` name of SLEEP_TAGS (None: all), weights first."""
        tags = list(SLEEP_TAGS) if tags is None else tags
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}; known: {', '.join(SLEEP_TAGS)}")
        if "kv_cache" in tags and "weights" in self.asleep and "weights" not in tags:
            raise ValueError("the KV cache lives in the model's layers: wake the weights "
                             "first, or both together")
        self.executor.wake_up(tags)
        self.asleep -= set(tags)

    def update_weights(self, model_path: str) -> None:
        """Serve the weights of `model_path` (a folder or .gguf of the same architecture and
        config) on every rank from now on, with the prefix cache dropped; the old weights
        stay when it cannot be loaded (ValueError). Raises EngineBusyError while requests
        are in flight."""
        if "weights" in self.asleep:
            raise ValueError("the weights are asleep: wake them up first")
        self._check_idle("a weight update")
        source = resolve_model(model_path, download_dir=self.config.download_dir)
        differ = config_differences(self.model_config.hf_config,
                                    load_config(source, self.config.trust_remote_code))
        if differ:
            raise ValueError(f"{model_path} is not a checkpoint of the served model's "
                             f"architecture: its config differs in {differ}")
        errors = self.executor.reload_weights(source)
        failed = [f"rank {rank}: {e}" for rank, e in enumerate(errors) if e is not None]
        if failed and len(failed) < len(errors):  # the other ranks took the new weights
            self.executor.reload_weights(self.weights_source)
        self.kv.pool.reset_prefix_cache()
        if not failed:
            self.weights_source = source
        self._new_kv_connector()
        if failed:
            raise ValueError(f"the weights of {model_path} could not be loaded (the old ones "
                             f"are served): {'; '.join(failed)}")
        logger.info("serving the weights of %s", model_path)

    def _flush_kv_connector(self) -> None:
        """One last step with no request, in which the workers keep what the connector wants to
        outlive the engine (the offload tier: the prefix cache, to disk)."""
        if self.asleep:  # the cache is gone: nothing to keep
            return
        orders = self.kv_connector.flush(self.kv.pool.cached_blocks())
        if not orders:
            return
        try:
            self.executor.execute(StepInput(kv_connector_meta=orders))
        except WorkerError as e:
            logger.warning("the KV connector's last step failed: %s", e)

    def _new_kv_connector(self) -> None:
        """A KV connector's scheduler side anew, as each worker's is when its cache is
        allocated again: the host level is gone with it, and the disk level is the served
        weights' namespace."""
        if self.kv_connector is None:
            return
        self.kv_connector.shutdown()
        self.kv_connector = build_scheduler_side(self.config, self.model_config,
                                                 self.weights_source, self.num_blocks)
        self.scheduler.set_connector(self.kv_connector)

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
        if self.kv_connector is not None:
            step_input.kv_connector_meta = self.kv_connector.build_connector_meta()
            step_input.kv_load_block_ids = [
                b for r, first, n in sched.loading for b in r.block_ids[first:first + n]]
        result = self.executor.execute(step_input)
        failed = dict(result.failed)  # e.g. a LoRA adapter that could not be read
        if self.fail_failed_loads and result.kv_connector_output is not None:
            for request_id in result.kv_connector_output.failed_loads:
                failed[request_id] = ("its KV could not be loaded from the KV connector "
                                      "(kv_load_failure_policy \"fail\")")
        # a sampled token the grammar refuses ends its request: finish_reason "abort", and why
        dead_ends = self.structured.accept(sched.scheduled, result.sampled)
        refused = {**failed, **dead_ends}
        finished = self.scheduler.update(sched, result.sampled, result.draft_token_ids,
                                         result.kv_connector_output)
        for request_id, error in refused.items():
            logger.error("request %s: %s", request_id, error)
            request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED,
                                                    error)
            if request is not None:
                finished.append(request)
                if request_id in failed:
                    self.failed.append((request, error))
        self.step_inputs.finished(r.request_id for r in finished)
        if self.kv_connector is not None:
            self._run_finished_orders()
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
                pooling_output=None if pooled is None else PooledTensor.of(pooled),
                kv_transfer_params=r.finished_kv_transfer_params))
        # a request refused in a step that computed none of it (its KV load failed)
        scheduled = {r.request_id for r, _ in sched.scheduled}
        outputs += [CoreOutput(r.request_id, [], finish_reason=r.status.finish_reason,
                               stop_reason=r.stop_reason) for r in finished
                    if r.request_id in refused and r.request_id not in scheduled]
        return outputs

    def _run_finished_orders(self) -> None:
        """What the KV connector ordered for the requests that just finished (a producer
        saving their KV), carried out by every worker now, in a step with no forward: before
        the outputs leave, so the KV is there when another instance asks for it."""
        orders = self.kv_connector.build_connector_meta()
        if orders:
            result = self.executor.execute(StepInput(kv_connector_meta=orders))
            self.kv_connector.update_connector_output(result.kv_connector_output or
                                                      KVConnectorOutput())
