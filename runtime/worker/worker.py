"""A worker: one device, the model (or this rank's shard of it), its KV cache and runner."""
from __future__ import annotations

import dataclasses
import gc
import logging
import os

import torch

from runtime.attention_backends.base import is_fp8, kv_cache_torch_dtype
from runtime.attention_backends.context_parallel import ContextParallel
from runtime.config import EngineConfig
from runtime.core.messages import StepInput, StepOutput
from runtime.distributed.groups import init_groups
from runtime.distributed.layout import ParallelLayout, host_share
from runtime.distributed.pipeline import PipelineStage
from runtime.kv_transfer.registry import build_worker_side
from runtime.forward_context import forward_context, get_forward_context
from runtime.layers.build_context import BuildContext
from runtime.model_config import ModelConfig
from runtime.model_loader.build import build_model, model_info
from runtime.model_loader.source import ModelSource
from runtime.plugins.answers import PlatformAnswers
from runtime.plugins.interfaces import CaptureSpec, ModelInfo, Platform
from runtime.plugins.selection import select_platform
from runtime.pooling.models import is_encoder_only, pooling_model_class
from runtime.pooling.pooler import load_pooler_config
from runtime.sampling.generators import SeededGenerators
from runtime.worker.micro_batches import merge_outputs, micro_batches
from runtime.worker.model_runner import ModelRunner
from runtime.worker.pooling_runner import PoolingRunner

logger = logging.getLogger(__name__)


class Worker:
    """Global `rank` in the layout of `config`; `local_rank` picks the device on its machine;
    `init_method` (a torch.distributed URL) is how the ranks find each other when there are
    several."""

    def __init__(self, config: EngineConfig, platform: Platform, source: ModelSource,
                 model_config: ModelConfig, rank: int = 0, local_rank: int = 0,
                 init_method: str | None = None) -> None:
        self.config = config
        self.platform = platform
        self.source = source
        self.model_config = model_config
        self.rank = rank
        self.layout = ParallelLayout.of(config)
        self.init_method = init_method
        self.device = platform.device(local_rank)
        platform.set_device(self.device)  # before anything touches the device (rank != GPU 0)
        # every hook's answer for this worker, asked once, with who answered
        self.answers = PlatformAnswers(platform, config.attention_backend)
        self.runner: ModelRunner | None = None
        self.lora = None  # the LoRAManager, with --enable-lora
        self.num_blocks = 0
        self.num_checkpoints = 0
        # a KV connector's worker side (--kv-transfer-config), once the cache exists
        self.kv_connector = None
        self.asleep: set[str] = set()  # what sleep freed: "weights", "kv_cache"

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache is kept in (`--kv-cache-dtype`; "auto": the model's)."""
        return kv_cache_torch_dtype(self.config.kv_cache_dtype, self.model_config.dtype)

    def model_info(self) -> ModelInfo:
        cfg = self.config
        # A later pipeline stage's forward takes the previous stage's hidden states, which graph
        # runners do not capture, pooling models never decode, and graph runners capture no
        # recurrent state slots, and decode context parallel reads the host's sequence
        # lengths: they run it eagerly.
        return model_info(self.model_config, self.kv_cache_dtype, cfg.block_size,
                          enforce_eager=cfg.enforce_eager or self.layout.pp_size > 1
                          or self.layout.dcp_size > 1
                          or cfg.runner == "pooling" or self.model_config.is_hybrid,
                          pooling=is_encoder_only(cfg, self.model_config))

    def _build_context(self, backend: type, quant_config) -> BuildContext:
        layout, rank = self.layout, self.rank
        tp_group = pp_group = dcp_group = None
        if layout.world_size > 1:
            tp_group, pp_group, dcp_group = init_groups(self.answers.communicator, layout, rank,
                                                        self.init_method)
        return BuildContext(dtype=self.model_config.dtype, device=self.device,
                            attention_backend=backend, quant_config=quant_config,
                            tp_rank=layout.tp_rank(rank), tp_size=layout.tp_size,
                            tp_group=tp_group, ep_size=layout.ep_size, dcp_group=dcp_group,
                            pp=PipelineStage(layout.pp_rank(rank), layout.pp_size, pp_group),
                            custom_op_provider=self.answers.custom_op,
                            max_model_len=self.model_config.max_model_len)

    def load_model(self) -> None:
        """Join the parallel groups, then build this rank's model and runner from `source`."""
        info = self.model_info()
        self.attention_backend = self.answers.attention_backend(info)
        if self.layout.dcp_size > 1 and not self.attention_backend.can_return_lse:
            raise ValueError(f"decode context parallel needs an attention backend that returns "
                             f"the log-sum-exp it merges the ranks' partial outputs by; "
                             f"{self.attention_backend.name} does not (torch_paged, "
                             f"cpu_paged and triton_paged do)")
        from runtime.quantization.registry import build_quant_config
        quant_config = build_quant_config(self.config.quantization, self.model_config.hf_config,
                                          self.answers.quantization_kernel)
        self.ctx = self._build_context(self.attention_backend, quant_config)
        vision = getattr(self.model_config.hf_config, "vision_config", None)
        if vision is not None:  # the vision tower's bidirectional attention, no KV cache
            heads = vision.num_attention_heads
            width = getattr(vision, "embed_dim", None) or vision.hidden_size  # Qwen2-VL's
            self.ctx.encoder_attention_backend = self.answers.attention_backend(
                dataclasses.replace(info, head_size=width // heads,
                                    num_heads=heads, num_kv_heads=heads, sliding_window=None,
                                    pooling=True, mm_prefix_lm=False), about="vision encoder")
        self._build_runner(self.source)
        logger.info("loaded %s (%s, %.1f MiB) with attention backend %s, %s execution",
                    self.model_config.architecture,
                    str(self.model_config.dtype).replace("torch.", ""), self.model_bytes / 2**20,
                    self.attention_backend.name, self.runner.graph_runner.name)

    def _build_runner(self, source: ModelSource) -> None:
        """The model with `source`'s weights and the runner around it (in the parallel groups
        joined once, in `load_model`); sleep level 2 and a weight reload come back here."""
        mc, cfg, ctx = self.model_config, self.config, self.ctx
        raw_gguf = bool(getattr(ctx.quant_config, "raw_gguf_weights", False))
        if raw_gguf and source.format != "gguf":
            raise ValueError(f"--quantization {ctx.quant_config.name} needs a .gguf model, "
                             f"got {source.path}")
        model_class = mc.choice.model_class
        if cfg.runner == "pooling":
            model_class = pooling_model_class(model_class)
        model = build_model(model_class, mc.hf_config, ctx, source, raw_gguf)
        info = self.model_info()
        graph_runner = self.answers.graph_runner(info, info.enforce_eager)
        pooling = lora = proposer = None
        if cfg.runner == "pooling":
            pooling = PoolingRunner(model, load_pooler_config(
                source.path if os.path.isdir(source.path) else None,
                model_class.encoder_only), model_class.encoder_only, self.device)
        if cfg.enable_lora:
            from runtime.lora.manager import LoRAManager
            lora = LoRAManager(model, mc.hf_config, cfg.max_loras, cfg.max_lora_rank,
                               cfg.max_cpu_loras, ctx.custom_op, self.device)
        generators = SeededGenerators(self.device)
        if cfg.speculative_config is not None:
            from runtime.spec_decode.proposer import build_proposer
            proposer = build_proposer(cfg.speculative_config, mc, self.answers, generators,
                                      self.device, cfg.block_size, cfg)
        self.lora = lora
        # what pipeline stages exchange: the model dtype unless the model says otherwise
        # (Mamba's float32 residual stream)
        pp_dtype = getattr(model, "intermediate_dtype", mc.dtype)
        self.runner = ModelRunner(model, self.device, cfg.block_size, mc.vocab_size,
                                  graph_runner, ctx.pp, (mc.hidden_size, pp_dtype),
                                  hooks=[lora] if lora is not None else [], proposer=proposer,
                                  pooling=pooling, generators=generators,
                                  logits_processors=self.answers.logits_processors(),
                                  greedy_argmax=ctx.custom_op("greedy_argmax"),
                                  dcp=self._context_parallel())
        self.model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # this rank's layers and KV heads only
        self.kv_bytes_per_block = self.runner.kv_cache.bytes_per_block(cfg.block_size,
                                                                       self.kv_cache_dtype)
        if proposer is not None:  # a draft model's KV shares the blocks
            self.kv_bytes_per_block += proposer.kv_bytes_per_block
        # a hybrid model's recurrent layers: one state slot per sequence the scheduler runs
        self.num_state_slots = cfg.max_num_seqs if self.runner.state_cache.layers else 0
        if is_fp8(self.kv_cache_dtype) and not cfg.calculate_kv_scales and all(
                m.impl.k_scale.item() == m.impl.v_scale.item() == 1.0
                for m in self.runner.kv_cache.layers):
            logger.warning("FP8 KV cache with scales 1.0 (the checkpoint has none): K and V "
                           "below %g lose precision; --calculate-kv-scales sets the scales "
                           "from the first batch", torch.finfo(self.kv_cache_dtype).smallest_normal)

    def _context_parallel(self) -> ContextParallel | None:
        """This rank's place in its decode-context-parallel group (None: dcp 1)."""
        layout = self.layout
        if layout.dcp_size == 1:
            return None
        return ContextParallel(layout.dcp_rank(self.rank), layout.dcp_size,
                               self.config.cp_kv_cache_interleave_size)

    def state_bytes_per_slot(self) -> int:
        """Bytes of one recurrent state slot over this rank's layers (0: none)."""
        return self.runner.state_cache.bytes_per_slot

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit in this device's KV-cache budget.

        Accelerators measure the activation peak of the largest batch first (a profiling
        forward pass), so the cache gets what the weights and that peak leave. A hybrid
        model's recurrent state slots come out of the same budget first.
        """
        mc, cfg = self.model_config, self.config
        per_block = self.kv_bytes_per_block
        self.platform.set_memory_utilization(cfg.gpu_memory_utilization)
        num_tokens = min(cfg.max_num_batched_tokens, mc.max_model_len)
        activation = self.platform.measure_peak_memory(
            lambda: self.runner.profile_run(num_tokens, min(cfg.max_num_seqs, num_tokens),
                                            self.kv_cache_dtype))
        budget = self.platform.kv_cache_memory_bytes(cfg.kv_cache_memory,
                                                     self.model_bytes + activation)
        # Never hold more than every sequence slot could use at full length (a block holds
        # block_size tokens of each decode-context-parallel rank).
        tokens_per_block = self.config.block_size * self.layout.dcp_size
        cap = self.config.max_num_seqs * -(-mc.max_model_len // tokens_per_block)
        state_bytes = self.num_state_slots * self.state_bytes_per_slot()
        if state_bytes > budget:
            raise ValueError(f"the recurrent state of {self.num_state_slots} sequences "
                             f"({state_bytes / 2**20:.1f} MiB) does not fit the KV-cache budget "
                             f"({budget / 2**20:.1f} MiB): raise --kv-cache-memory or lower "
                             "--max-num-seqs")
        budget -= state_bytes
        if per_block == 0:  # no attention layer: blocks only count tokens
            return cap
        return min(budget // per_block, cap)

    def init_kv_cache(self, num_blocks: int, num_checkpoints: int = 0) -> None:
        """Allocate the cache (and a hybrid's `num_checkpoints` state checkpoint entries), then
        let the graph runner record what it records over it."""
        self.runner.allocate_kv_cache(num_blocks, self.kv_cache_dtype, self.num_state_slots,
                                      num_checkpoints)
        self.num_blocks = num_blocks
        self.num_checkpoints = num_checkpoints
        cfg = self.config
        if self.kv_connector is not None:  # the cache is new: so is the connector's side
            self.kv_connector.shutdown()
        self.kv_connector = build_worker_side(cfg, self.model_config, self.source, self.rank)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.runner.kv_cache.connector_layers())
        self.runner.layer_connector = self.kv_connector if self.kv_connector is not None \
            and self.kv_connector.uses_layer_hooks else None
        self.runner.graph_runner.capture(self.runner.model.forward, CaptureSpec(
            forward_context=forward_context, current_metadata=get_forward_context,
            attention_backend=self.attention_backend, device=self.device,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.model_config.max_model_len, block_size=cfg.block_size))
        if cfg.calculate_kv_scales and is_fp8(self.kv_cache_dtype):
            # armed only now: the profile and capture runs see no real activations
            for layer in self.runner.kv_cache.layers:
                layer.calculate_kv_scales = True

    def sleep(self, level: int) -> None:
        """Free the KV cache and the recorded graphs over it (level 1), and the model too
        (level 2: rebuilt from `source` on wake-up). The engine calls it with no request in
        flight; a deeper sleep than the current one frees what is still held."""
        if "kv_cache" not in self.asleep:
            self.runner.release_kv_cache()
            if self.kv_connector is not None:
                self.kv_connector.shutdown()
            # it holds the cache too: a new one comes with the next cache
            self.kv_connector = self.runner.layer_connector = None
            info = self.model_info()
            self.runner.graph_runner = self.answers.graph_runner(info, info.enforce_eager)
            self.asleep.add("kv_cache")
        if level == 2 and "weights" not in self.asleep:
            self.runner = self.lora = None
            self.asleep.add("weights")
        gc.collect()
        self.platform.empty_cache()

    def wake_up(self, tags: list[str]) -> None:
        """Bring back what `tags` name ("weights", "kv_cache") of what sleep freed: the weights
        from `source`, then the KV cache (empty: the engine dropped its prefix cache)."""
        if "weights" in tags and "weights" in self.asleep:
            self._build_runner(self.source)
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:  # the engine woke the weights
            self.init_kv_cache(self.num_blocks, self.num_checkpoints)
            self.asleep.discard("kv_cache")

    def reload_weights(self, source: ModelSource) -> str | None:
        """Serve `source`'s weights (a checkpoint the engine checked has this architecture and
        shapes) from now on; returns None, or why they could not be loaded (the old weights
        are loaded again: a failed reload leaves the engine serving). The old model is freed
        first, so the peak is one model."""
        self.runner = self.lora = None
        gc.collect()
        error = None
        try:
            self._build_runner(source)
            self.source = source
        except Exception as e:
            logger.exception("the weights of %s could not be loaded", source.path)
            error = f"{type(e).__name__}: {e}"
            self._build_runner(self.source)
        if "kv_cache" not in self.asleep:
            self.init_kv_cache(self.num_blocks, self.num_checkpoints)
        self.platform.empty_cache()
        return error

    def execute(self, step: StepInput) -> StepOutput:
        if self.kv_connector is not None:  # before the step's requests touch their blocks
            self.runner.kv_cache.prepare_blocks(step.kv_load_block_ids)
            self.kv_connector.start_load_kv(step.kv_connector_meta)
        reqs = self.runner.update_states(step)
        if self.layout.pp_size == 1:
            out = self.runner.execute(reqs)
        else:  # micro-batches: the stages work on different parts of the step at the same time
            out = merge_outputs([self.runner.execute(part)
                                 for part in micro_batches(reqs, self.layout.pp_size)])
        if self.kv_connector is not None:
            self.kv_connector.wait_for_save()
            out.kv_connector_output = self.kv_connector.get_finished()
        self.platform.rebalance_threads()
        return out


def start_worker(config: EngineConfig, platform_name: str, source: ModelSource,
                 model_config: ModelConfig, rank: int, local_rank: int, host_index: int,
                 host_ranks: int, init_method: str) -> Worker:
    """A worker in a process of its own (a multiprocessing child or a Ray actor): picks the
    engine's platform by name, takes its share of the host's cores (it is rank `host_index`
    of the engine's `host_ranks` ranks there) and loads this rank's part of the model on
    device `local_rank`."""
    platform = select_platform(platform_name)
    platform.set_threads(config.num_threads, *host_share(config, host_index, host_ranks))
    torch.manual_seed(config.seed)
    worker = Worker(config, platform, source, model_config, rank, local_rank, init_method)
    worker.load_model()
    return worker
