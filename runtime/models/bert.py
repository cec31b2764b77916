"""BERT encoders (`BertModel`) and BERT cross-encoders / classifiers
(`BertForSequenceClassification`), for the pooling runner.

Bidirectional attention through the attention backend's encoder-only mode (no KV cache). Module
names follow the Hugging Face checkpoints (`embeddings.*`, `encoder.layer.{i}.*`, `pooler.*`,
`classifier.*`), so weights load by name, but for the query, key and value projections, which
load into one fused `qkv`. The encoder's dense layers run on the platform's `linear` kernel, erf
GELU on its `gelu` and the output blocks' add + LayerNorm on its `add_layer_norm` where it has
them. One rank, unquantized.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.linear import QKVParallelLinear, ReplicatedLinear
from runtime.model_config import attention_heads
from runtime.models.llama import default_weight_loader

ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# checkpoint tensors that are not weights of ours: buffers, and heads of other tasks
IGNORED = ("position_ids", "cls.", "lm_head.")
QKV_SHARDS = {"attention.self.query.": "q", "attention.self.key.": "k",
              "attention.self.value.": "v"}


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        heads, _, head_size = attention_heads(config)
        self.qkv = QKVParallelLinear(config.hidden_size, head_size, heads, heads, True, ctx)
        self.attn = Attention(heads, head_size, head_size ** -0.5, heads, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(*self.qkv(x).chunk(3, dim=-1))


class BertOutput(nn.Module):
    """`LayerNorm(dense(x) + residual)`: the output block after attention and after the MLP."""

    def __init__(self, config, in_features: int, ctx: BuildContext) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(in_features, config.hidden_size, True, ctx)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.add_norm = ctx.custom_op("add_layer_norm")

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.add_norm is None:
            return self.LayerNorm(self.dense(x) + residual)
        norm = self.LayerNorm
        return self.add_norm(self.dense(x), residual, norm.weight, norm.bias, norm.eps)


class BertAttention(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, ctx)
        self.output = BertOutput(config, config.hidden_size, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class BertIntermediate(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"activation {config.hidden_act!r} is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        self.dense = ReplicatedLinear(config.hidden_size, config.intermediate_size, True, ctx)
        self.act = ((config.hidden_act == "gelu" and ctx.custom_op("gelu"))
                    or ACTIVATIONS[config.hidden_act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.attention = BertAttention(config, ctx)
        self.intermediate = BertIntermediate(config, ctx)
        self.output = BertOutput(config, config.intermediate_size, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, ctx)
                                   for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class BertPooler(nn.Module):
    """tanh(dense(first token)): BERT's sentence vector, which its classifier reads."""

    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first_tokens))


class BertModel(nn.Module):
    """The encoder: token ids, positions (0-based within each request) and token types to the
    last hidden states [num_tokens, hidden]. The pooling runner pools them."""

    encoder_only = True
    position_offset = 0  # RoBERTa counts positions from padding_idx + 1
    checkpoint_prefix = "bert."  # stripped when a task model's checkpoint is loaded

    def __init__(self, config, ctx: BuildContext, add_pooler: bool = False) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config, ctx)
        self.pooler = BertPooler(config) if add_pooler else None
        self.to(ctx.dtype)  # torch.nn layers are made in float32

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, positions + self.position_offset, token_type_ids)
        return self.encoder(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_by_name(self, weights, prefix=self.checkpoint_prefix)


def load_by_name(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 prefix: str = "") -> set[str]:
    """Copy checkpoint tensors into the parameters of the same name (a leading `prefix` dropped;
    query, key and value into their shard of the fused `qkv`); tensors of heads this model
    lacks (a pooler it does not use, an MLM head) are skipped."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        name = name.removeprefix(prefix)
        shard = next(((part, s) for part, s in QKV_SHARDS.items() if part in name), None)
        if shard is not None:
            name = name.replace(shard[0], "attention.self.qkv.")
            if name in params:
                params[name].weight_loader(params[name], tensor, shard[1])
                loaded.add(name)
                continue
        if name not in params:
            if name.startswith("pooler.") or any(part in name for part in IGNORED):
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in "
                             f"{type(model).__name__}")
        default_weight_loader(params[name], tensor)
        loaded.add(name)
    return loaded


class BertForSequenceClassification(nn.Module):
    """A cross-encoder or classifier: `classify` turns each request's first-token hidden state
    into its `num_labels` logits (pooler, then the linear classifier)."""

    encoder_only = True

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config, ctx, add_pooler=True)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, dtype=ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.bert(input_ids, positions, token_type_ids)

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.bert.pooler(first_tokens))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_by_name(self, weights)
