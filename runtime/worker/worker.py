"""A worker: one device, the model (or this rank's shard of it), its KV cache and runner."""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from runtime.attention_backends.base import is_fp8, kv_cache_torch_dtype
from runtime.plugins.interfaces import CaptureSpec, ModelInfo, Platform
from runtime.plugins.manager import get_plugin_manager
from runtime.plugins.selection import select_platform
from runtime.config import EngineConfig
from runtime.distributed.groups import init_groups
from runtime.distributed.layout import ParallelLayout, host_share
from runtime.distributed.pipeline import PipelineStage
from runtime.forward_context import forward_context, get_forward_context
from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.custom_ops import CustomOps
from runtime.model_config import ModelConfig
from runtime.model_loader.source import ModelSource, iterate_weights
from runtime.pooling.models import is_encoder_only, pooling_model_class
from runtime.pooling.pooler import load_pooler_config
from runtime.pooling.runner import PoolingRunner
from runtime.worker.inputs import StepInput, StepOutput
from runtime.worker.micro_batches import merge_outputs, micro_batches
from runtime.worker.model_runner import ModelRunner

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
        self.hook = get_plugin_manager().hook
        self.runner: ModelRunner | None = None
        self.num_blocks = 0

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache is kept in (`--kv-cache-dtype`; "auto": the model's)."""
        return kv_cache_torch_dtype(self.config.kv_cache_dtype, self.model_config.dtype)

    def model_info(self) -> ModelInfo:
        mc = self.model_config
        return ModelInfo(architecture=mc.architecture, dtype=mc.dtype,
                         kv_cache_dtype=self.kv_cache_dtype,
                         head_size=mc.head_size, num_heads=mc.num_heads,
                         num_kv_heads=mc.num_kv_heads, sliding_window=mc.sliding_window,
                         block_size=self.config.block_size,
                         # A later pipeline stage's forward takes the previous stage's hidden
                         # states, which graph runners do not capture, and pooling models
                         # never decode: they run it eagerly.
                         enforce_eager=self.config.enforce_eager or self.layout.pp_size > 1
                         or self.config.runner == "pooling",
                         pooling=is_encoder_only(self.config, mc))

    def _build_context(self, backend: type, quant_config) -> BuildContext:
        layout, rank = self.layout, self.rank
        tp_group = pp_group = None
        if layout.world_size > 1:
            tp_group, pp_group = init_groups(self.hook, self.platform, layout, rank,
                                             self.init_method)
        return BuildContext(dtype=self.model_config.dtype, device=self.device,
                            attention_backend=backend, quant_config=quant_config,
                            tp_rank=layout.tp_rank(rank), tp_size=layout.tp_size,
                            tp_group=tp_group, ep_size=layout.ep_size,
                            pp=PipelineStage(layout.pp_rank(rank), layout.pp_size, pp_group),
                            custom_op_provider=CustomOps(self.platform),
                            max_model_len=self.model_config.max_model_len)

    def load_model(self) -> None:
        mc = self.model_config
        info = self.model_info()
        backend = self.hook.runtime_attention_backend(platform=self.platform, model=info,
                                                      requested=self.config.attention_backend)
        if backend is None:
            raise RuntimeError(f"no plugin supplies an attention backend for platform "
                               f"{self.platform.name!r}")
        self.attention_backend = backend
        from runtime.quantization.registry import build_quant_config
        quant_config = build_quant_config(self.config.quantization, mc.hf_config,
                                          self.platform, self.hook)
        ctx = self._build_context(backend, quant_config)
        raw_gguf = bool(getattr(quant_config, "raw_gguf_weights", False))
        if raw_gguf and self.source.format != "gguf":
            raise ValueError(f"--quantization {quant_config.name} needs a .gguf model, "
                             f"got {self.source.path}")
        model_class = mc.choice.model_class
        if self.config.runner == "pooling":
            model_class = pooling_model_class(model_class)
        model = self.build_model(model_class, mc.hf_config, mc.dtype, ctx, self.source, raw_gguf)
        graph_runner = self.hook.runtime_graph_runner(platform=self.platform, model=info,
                                                      enforce_eager=info.enforce_eager)
        self.runner = ModelRunner(model, self.device, self.config.block_size, mc.vocab_size,
                                  graph_runner, ctx.pp, (mc.hidden_size, mc.dtype))
        if self.config.runner == "pooling":
            self.runner.pooling = PoolingRunner(model, load_pooler_config(
                self.source.path if os.path.isdir(self.source.path) else None,
                model_class.encoder_only), model_class.encoder_only)
        if self.config.enable_lora:
            from runtime.lora.manager import LoRAManager
            cfg = self.config
            self.runner.lora = LoRAManager(model, mc.hf_config, cfg.max_loras, cfg.max_lora_rank,
                                           cfg.max_cpu_loras, ctx.custom_op, self.device)
        self.model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        itemsize = self.kv_cache_dtype.itemsize
        self.kv_bytes_per_block = sum(  # this rank's layers and KV heads only
            2 * self.config.block_size * m.num_kv_heads * m.head_size * itemsize
            for m in model.modules() if isinstance(m, Attention))
        if is_fp8(self.kv_cache_dtype) and not self.config.calculate_kv_scales and all(
                m.impl.k_scale.item() == m.impl.v_scale.item() == 1.0
                for m in model.modules() if isinstance(m, Attention)):
            logger.warning("FP8 KV cache with scales 1.0 (the checkpoint has none): K and V "
                           "below %g lose precision; --calculate-kv-scales sets the scales "
                           "from the first batch", torch.finfo(self.kv_cache_dtype).smallest_normal)
        self._load_proposer()
        logger.info("loaded %s (%s, %.1f MiB) with attention backend %s, %s execution",
                    mc.architecture, str(mc.dtype).replace("torch.", ""), self.model_bytes / 2**20,
                    backend.name, self.runner.graph_runner.name)

    def build_model(self, model_cls: type, hf_config: Any, dtype: torch.dtype,
                    ctx: BuildContext, source: ModelSource, raw_gguf: bool = False) -> nn.Module:
        """Build a model on this worker's device, load its weights from `source` and let each
        layer's method process them (packing for the platform's `linear` or quantization
        kernel). The target model and a draft model both load this way."""
        with torch.device(self.device):
            model = model_cls(hf_config, ctx)
        loaded = model.load_weights(iterate_weights(source, hf_config, dtype, raw_gguf=raw_gguf))
        missing = {n for n, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint {source.path} lacks weights: {sorted(missing)[:8]}")
        for module in model.modules():
            method = getattr(module, "method", None)
            if method is not None:
                method.process_weights_after_loading(module)
        return model.eval()

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit in this device's KV-cache budget.

        Accelerators measure the activation peak of the largest batch first (a profiling
        forward pass), so the cache gets what the weights and that peak leave.
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
        # Never hold more than every sequence slot could use at full length.
        cap = self.config.max_num_seqs * -(-mc.max_model_len // self.config.block_size)
        return min(budget // per_block, cap)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache, then let the graph runner record what it records over it."""
        self.runner.allocate_kv_cache(num_blocks, self.kv_cache_dtype)
        if self.runner.proposer is not None:
            self.runner.proposer.allocate_kv_cache(num_blocks, self.config.block_size,
                                                   self.model_config.dtype)
        self.num_blocks = num_blocks
        cfg = self.config
        self.runner.graph_runner.capture(self.runner.model.forward, CaptureSpec(
            forward_context=forward_context, current_metadata=get_forward_context,
            attention_backend=self.attention_backend, device=self.device,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.model_config.max_model_len, block_size=cfg.block_size))
        if cfg.calculate_kv_scales and is_fp8(self.kv_cache_dtype):
            # armed only now: the profile and capture runs see no real activations
            for layer in self.runner.kv_layers:
                layer.calculate_kv_scales = True

    def _load_proposer(self) -> None:
        """Speculative decoding: the runner's proposer; a draft model's KV shares the blocks."""
        spec = self.config.speculative_config
        if spec is None:
            return
        from runtime.spec_decode.proposer import build_proposer
        self.runner.proposer = build_proposer(spec, self)
        self.kv_bytes_per_block += self.runner.proposer.kv_bytes_per_block

    def execute(self, step: StepInput) -> StepOutput:
        reqs = self.runner.update_states(step)
        if self.layout.pp_size == 1:
            return self.runner.execute(reqs)
        # Micro-batches: the stages work on different parts of the step at the same time.
        return merge_outputs([self.runner.execute(part)
                              for part in micro_batches(reqs, self.layout.pp_size)])


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
