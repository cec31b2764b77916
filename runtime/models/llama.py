"""The Llama family: Llama 2/3, TinyLlama, SmolLM, Mistral; Qwen2 and Qwen3 reuse it."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from runtime.distributed.pipeline import Intermediate
from runtime.layers.activation import GATED_ACTIVATIONS
from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from runtime.layers.rotary import get_rope, rotary_embedding
from runtime.model_config import attention_heads
from runtime.model_loader.kv_scales import load_kv_scale


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """The sliding window of one layer, following the HF config's `layer_types` when present."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


class LlamaAttention(nn.Module):
    qkv_bias = False  # Qwen2 turns this on
    qk_norm = False  # Qwen3 and Gemma 3 turn this on
    attention_sinks = False  # gpt-oss turns this on
    norm_cls = RMSNorm

    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads, num_kv_heads, self.head_size = attention_heads(config)
        bias = self.qkv_bias or getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, num_heads, num_kv_heads, bias,
                                          ctx, f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(num_heads * self.head_size, hidden,
                                        getattr(config, "attention_bias", False), ctx,
                                        f"{prefix}.o_proj")
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.rotary_emb = (get_rope(self.head_size,
                                    ctx.max_model_len or config.max_position_embeddings,
                                    self.rope_config(config, layer_idx), ctx.dtype)
                           if self.uses_rope(config) else None)
        self.rotary_op = ctx.custom_op("rotary_embedding") or rotary_embedding
        self.attn = Attention(self.num_heads, self.head_size, self.attention_scale(config),
                              self.num_kv_heads, ctx, layer_sliding_window(config, layer_idx),
                              getattr(config, "attn_logit_softcapping", None),
                              sinks=self.attention_sinks,
                              attention_chunk_size=self.attention_chunk_size(config, layer_idx))
        if self.qk_norm:
            self.q_norm = self.norm_cls(self.head_size, config.rms_norm_eps, ctx)
            self.k_norm = self.norm_cls(self.head_size, config.rms_norm_eps, ctx)

    def attention_scale(self, config) -> float:
        return self.head_size ** -0.5

    def attention_chunk_size(self, config, layer_idx: int) -> int | None:
        """The chunk of chunked attention in layer `layer_idx` (Llama 4), None for none."""
        return None

    def uses_rope(self, config) -> bool:
        """Whether the layer rotates q and k (the attention of some hybrids does not)."""
        return True

    def rope_config(self, config, layer_idx: int):
        """What `get_rope` reads the rope settings of layer `layer_idx` from."""
        return config

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.size(0)
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        if self.qk_norm:
            q = self.q_norm(q.view(t, self.num_heads, self.head_size)).view(t, -1)
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_size)).view(t, -1)
        if self.rotary_emb is not None:
            q, k = self.rotary_op(positions, q, k, self.rotary_emb.cos_sin_cache,
                                  self.head_size)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config, ctx: BuildContext, prefix: str,
                 intermediate_size: int | None = None) -> None:
        """`intermediate_size`: the config's unless given (an MoE model's shared expert)."""
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in GATED_ACTIVATIONS:
            raise ValueError(f"MLP activation {act!r} is not supported; supported: "
                             f"{', '.join(GATED_ACTIVATIONS)}")
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [intermediate_size] * 2,
            getattr(config, "mlp_bias", False), ctx, f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size,
                                           getattr(config, "mlp_bias", False), ctx,
                                           f"{prefix}.down_proj")
        self.act_fn = GATED_ACTIVATIONS[act](ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, ctx, f"{prefix}.self_attn")
        self.mlp = self.build_mlp(config, layer_idx, ctx, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def build_mlp(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> nn.Module:
        """The feed-forward block of layer `layer_idx` (MoE models put their experts here)."""
        return LlamaMLP(config, ctx, prefix)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer
    norm_cls = RMSNorm

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        # A pipeline stage builds its own layers only; the others stay empty placeholders so
        # that layer i keeps the checkpoint's name `model.layers.{i}`.
        self.hidden_size = config.hidden_size
        self.start, self.end = ctx.pp.layers(config.num_hidden_layers)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
                             if ctx.pp.is_first else None)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, ctx, f"model.layers.{i}") if self.start <= i < self.end
            else nn.Identity() for i in range(config.num_hidden_layers))
        self.norm = (self.norm_cls(config.hidden_size, config.rms_norm_eps, ctx)
                     if ctx.pp.is_last else None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.scale_embeds(self.embed_tokens(input_ids))

    def scale_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        """What the first layer takes of rows of the embedding table (a family that scales
        them, Gemma or Granite, does it here)."""
        return embeds

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Intermediate | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | Intermediate:
        """The final hidden states. A pipeline stage after the first starts from the previous
        stage's `intermediate` output instead of `input_ids`; one before the last returns its
        own (the runner sends it on). `inputs_embeds` (a multimodal model's text and image
        embeddings) replace the embedding of `input_ids`."""
        if intermediate is None:
            hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden, residual = intermediate
        for layer in self.layers[self.start:self.end]:
            hidden, residual = layer(positions, hidden, residual)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    # prompts given as embeddings (runtime.engine.prompt_embeds) replace the token embeddings
    supports_prompt_embeds = True
    # checkpoint name -> (our fused parameter, shard id)
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.config = config
        self.pp = ctx.pp
        self.model = self.model_cls(config, ctx)
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, ctx)
                        if ctx.pp.is_last else None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings and ctx.pp.size == 1:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Intermediate | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | Intermediate:
        return self.model(input_ids, positions, intermediate, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def scale_inputs_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        """Prompt embeddings as transformers takes `inputs_embeds` (rows of the input
        embedding table), made what the first layer takes."""
        return self.model.scale_embeds(embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into our parameters; returns the names loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        num_layers = self.config.num_hidden_layers
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings:
                if name == "lm_head.weight":
                    continue
                if name == "model.embed_tokens.weight" and self.pp.size > 1 and self.pp.is_last:
                    self.lm_head.weight.weight_loader(self.lm_head.weight, tensor)
                    loaded.add("lm_head.weight")
            if not self.pp.owns(name, num_layers) or load_kv_scale(self, name, tensor):
                continue
            for ckpt_part, (param_part, shard_id) in self.stacked_params.items():
                if f".{ckpt_part}." in name:
                    target = name.replace(ckpt_part, param_part)
                    param = params[target]
                    param.weight_loader(param, tensor, shard_id)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                     f"{type(self).__name__}")
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        return loaded


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, "
                         f"checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class MistralForCausalLM(LlamaForCausalLM):
    pass
