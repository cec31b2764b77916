"""Where each rank sits: global rank = pp_rank * tp_size + tp_rank.

A tensor-parallel group is one pipeline stage's `tp_size` consecutive ranks; a pipeline group
links the ranks with the same tp_rank across stages; a decode-context-parallel group is
`dcp_size` consecutive ranks of a tensor-parallel group (they hold the same KV heads, as vLLM
groups them). The output (sampled tokens) comes from the last stage's tp_rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.config import EngineConfig
    from runtime.model_config import ModelConfig


@dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    pp_size: int = 1
    enable_expert_parallel: bool = False
    dcp_size: int = 1

    @classmethod
    def of(cls, config: EngineConfig) -> "ParallelLayout":
        return cls(config.tensor_parallel_size, config.pipeline_parallel_size,
                   config.enable_expert_parallel, config.decode_context_parallel_size)

    @property
    def ep_size(self) -> int:
        """The ranks MoE experts are split across: the tensor-parallel group, under expert
        parallel."""
        return self.tp_size if self.enable_expert_parallel else 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def output_rank(self) -> int:
        return (self.pp_size - 1) * self.tp_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_group(self, rank: int) -> list[int]:
        start = self.pp_rank(rank) * self.tp_size
        return list(range(start, start + self.tp_size))

    def pp_group(self, rank: int) -> list[int]:
        return list(range(self.tp_rank(rank), self.world_size, self.tp_size))

    def dcp_rank(self, rank: int) -> int:
        return self.tp_rank(rank) % self.dcp_size

    def dcp_group(self, rank: int) -> list[int]:
        start = rank - self.dcp_rank(rank)
        return list(range(start, start + self.dcp_size))


def check_model_fits(model_config: ModelConfig, layout: ParallelLayout) -> None:
    """Raise ValueError, saying what is allowed, when the model cannot be split this way."""
    tp, pp = layout.tp_size, layout.pp_size
    heads, kv_heads = model_config.num_heads, model_config.num_kv_heads
    if heads % tp:
        allowed = [n for n in range(1, heads + 1) if heads % n == 0]
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {heads} attention "
                         f"heads; allowed: {allowed}")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {kv_heads} KV "
                         f"heads, or be a multiple of it (KV heads are then replicated)")
    experts = num_experts(model_config.hf_config)
    if experts and experts % layout.ep_size:
        allowed = [n for n in range(1, experts + 1) if experts % n == 0 and heads % n == 0]
        raise ValueError(f"expert parallel splits the model's {experts} experts across the "
                         f"tensor_parallel_size {tp} ranks, which must divide them; allowed: "
                         f"{allowed}")
    if layout.dcp_size > 1:
        check_decode_context_parallel(model_config, layout)
    if pp > model_config.num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's "
                         f"{model_config.num_layers} layers (each stage needs at least one)")


def check_decode_context_parallel(model_config: ModelConfig, layout: ParallelLayout) -> None:
    """Raise ValueError, with the reason, for what decode context parallel cannot split."""
    tp, dcp, kv_heads = layout.tp_size, layout.dcp_size, model_config.num_kv_heads
    name = model_config.architecture
    if model_config.attention_kind == "mla":
        raise ValueError(f"decode context parallel is not built for MLA ({name}): its "
                         "latent cache and absorbed decode have no log-sum-exp merge here")
    if model_config.is_hybrid:
        raise ValueError(f"decode context parallel does not split {name}'s recurrent layers: "
                         "their state is one per sequence, not per token")
    if model_config.attention_sinks:
        raise ValueError(f"decode context parallel does not merge attention sinks ({name}): "
                         "the ranks' partial softmaxes would each count the sink")
    if tp % kv_heads or tp // kv_heads % dcp:
        raise ValueError(f"decode_context_parallel_size {dcp} splits the tokens of KV heads "
                         f"that tensor parallel replicates, so it must divide "
                         f"tensor_parallel_size / num_kv_heads (the ranks holding a copy of "
                         f"each of the model's {kv_heads} KV heads at tp {tp}): use a "
                         f"tensor_parallel_size that is a multiple of {kv_heads * dcp}")


def num_experts(hf_config) -> int:
    """The routed experts of an MoE config (Mixtral's `num_local_experts`, Qwen's
    `num_experts`); 0 for a dense model."""
    text = hf_config.get_text_config()
    return getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 0


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers [start, end) of one stage: an even split, earlier stages taking the remainder
    (the last stage also runs the LM head and sampling)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)


def host_share(config: EngineConfig, index: int, count: int) -> tuple[int, int]:
    """A rank's place among all the ranks on its host, (index, count), from its place among
    its engine's ranks there: data-parallel replica r's ranks come after the earlier ones'."""
    return (config.data_parallel_rank * count + index,
            config.data_parallel_size_local * count)
