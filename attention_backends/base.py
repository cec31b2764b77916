"""The attention-backend interface: attention over a paged (block-table) KV cache.

A step's batch is flat: the new tokens of every scheduled request are concatenated, prefill chunks
and decodes alike. Request i owns tokens `query_start_loc[i]:query_start_loc[i+1]` of the batch; its
context after this step is `seq_lens[i]` tokens, the last `query_lens[i]` of which are new, so a new
token at offset j of request i sits at position `seq_lens[i] - query_lens[i] + j`. Request i's KV lives
in the blocks `block_tables[i, :ceil(seq_lens[i] / block_size)]`; `slot_mapping[t]` is the flat slot
(`block * block_size + offset`) where token t's K and V are written.

The cache holds K and V in the model's dtype, or in FP8 (`--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2`)
for backends whose `fp8_kv_cache` is set: each element is stored as `x / scale`, saturated to the
format's largest finite value, and read back as `stored * scale`, with one scale for K and one for
V per layer (`AttentionBackend.k_scale`/`v_scale`, 1.0 unless a checkpoint or
`--calculate-kv-scales` sets them).

Pooling models run prefill-only steps: metadata with `prefill_only` set holds every request
whole, and the step neither writes nor reads the KV cache (pooling requests keep no KV). With
`causal=False` too (encoder-only models, the BERT family) each token attends to all tokens of its
own request, both ways. Backends whose `supports_encoder_attention` is set run such steps.
Selection (`runtime.plugins.backend_choice`) checks none of a backend's declarations: the
platform's candidate list does (`runtime.platforms.common.offer_backend` refuses such a backend
for a pooling model, and one whose `supports_kv_cache_dtype` refuses the cache), and the
conformance suite fails a platform whose usable candidates do not.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from runtime.attention_backends.context_parallel import ContextParallel

# vLLM's `--kv-cache-dtype` names for the FP8 formats; "fp8" is e4m3.
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                       "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = ("auto", *FP8_KV_CACHE_DTYPES)
# `--calculate-kv-scales` maps the first batch's largest |K| (|V|) to these values, as vLLM's
# K_SCALE_CONSTANT and V_SCALE_CONSTANT do: headroom for later, larger activations.
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache for a `--kv-cache-dtype` value ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    return FP8_KV_CACHE_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch reads and writes the KV cache. Built once per step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, on the device
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_reqs] int32, on the device
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on the device
    query_start_loc_cpu: list[int]  # host copies, for backends that loop or bucket on the host
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    num_decode_tokens: int = 0  # requests with query_len 1 come first: tokens [0, num_decodes)
    prefill_only: bool = False  # whole requests, no KV cache (pooling models)
    causal: bool = True  # False (with prefill_only): bidirectional, for encoder-only models
    # hybrid models' recurrent layers: each request's state slot [num_reqs] int64, and whether
    # it holds the state of the tokens before this step [num_reqs] bool (None: no such layers)
    state_indices: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    # their prefix-cache checkpoints: the state after each of these rows of the batch [C]
    # int64 (sorted; the first `num_decode_checkpoints` are decodes) goes to these entries of
    # the host checkpoint store [C] int64 (None: none this step)
    checkpoint_rows: torch.Tensor | None = None
    checkpoint_ids: torch.Tensor | None = None
    num_decode_checkpoints: int = 0
    # decode context parallel: this rank's place in its group; `slot_mapping` is then -1 for
    # the tokens other ranks keep, and `block_tables` address this rank's shard (None: off)
    dcp: ContextParallel | None = None
    # models whose image tokens attend to each other both ways (Gemma 3): per request, the
    # [start, end) positions of the image runs its new tokens reach (each run scheduled
    # whole); a query in a run also sees the run's later keys (None: causal only)
    mm_prefix_ranges: list[list[tuple[int, int]]] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


def prefill_only_metadata(lens: list[int], causal: bool,
                          device: str | torch.device = "cpu") -> AttentionMetadata:
    """The metadata of a pooling step: whole requests of `lens` tokens, no KV cache."""
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.empty(len(lens), 0, dtype=torch.int32, device=device),
        query_start_loc_cpu=starts, seq_lens_cpu=list(lens), max_query_len=max(lens),
        max_seq_len=max(lens), prefill_only=True, causal=causal)


class AttentionBackend(ABC):
    """One attention layer's kernel over the paged KV cache.

    A backend class is chosen once per engine through the `runtime_attention_backend` hook, then
    instantiated once per attention layer.
    """

    name: str = ""
    # The layers it runs: "mha" (K and V per KV head) or "mla" (`MLAAttentionBackend`); a
    # platform's candidate list refuses a backend of another kind than the model's layers.
    kind: str = "mha"
    # Which dimension of `kv_cache_shape` indexes blocks (the runner zeroes blocks on first use).
    kv_cache_block_dim: int = 1
    # Whether a decode step can be recorded as a device graph: the backend reads the metadata's
    # tensors only (never its host lists, which are frozen at capture) and skips slots < 0.
    graph_capturable: bool = False
    # Whether the backend can keep its cache in FP8 (e4m3 and e5m2, with per-layer K/V scales).
    fp8_kv_cache: bool = False
    # Whether the backend applies `logits_soft_cap` (Gemma 2's attention soft-capping).
    supports_logits_soft_cap: bool = False
    # Whether the backend runs pooling steps: `AttentionMetadata.prefill_only`, causal or not.
    supports_encoder_attention: bool = False
    # Whether the backend applies `sinks`, a learned logit per query head in each softmax
    # (gpt-oss). `runtime.platforms.common.offer_backend` refuses a backend without it for a
    # model whose `ModelInfo.attention_sinks` is set.
    supports_attention_sinks: bool = False
    # Whether the backend applies `attention_chunk_size` (Llama 4's chunked attention).
    supports_chunked_attention: bool = False
    # Whether the backend has `forward_with_lse`, which decode context parallel needs.
    can_return_lse: bool = False
    # Whether the backend applies `AttentionMetadata.mm_prefix_ranges` (Gemma 3's
    # bidirectional attention within an image). `runtime.platforms.common.offer_backend`
    # refuses a backend without it for a model whose `ModelInfo.mm_prefix_lm` is set.
    supports_mm_prefix: bool = False

    @classmethod
    def supports_kv_cache_dtype(cls, dtype: torch.dtype,
                                kv_cache_dtype: torch.dtype) -> tuple[bool, str]:
        """Whether this backend can keep the KV cache in `kv_cache_dtype` for a model computing
        in `dtype`, and if not, why. A platform's candidate list checks it before `supports`
        (selection does not)."""
        if kv_cache_dtype == dtype or (cls.fp8_kv_cache and is_fp8(kv_cache_dtype)):
            return True, ""
        if is_fp8(kv_cache_dtype):
            return False, (f"keeps the KV cache in the model dtype only, no FP8 "
                           f"({str(kv_cache_dtype).removeprefix('torch.')})")
        return False, f"KV-cache dtype {kv_cache_dtype} differs from the model's {dtype}"

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 sliding_window: int | None, device_type: str) -> tuple[bool, str]:
        """Whether this backend can run the given layer shape here, and if not, why."""
        return True, ""

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor; dimension 0 indexes K (0) and V (1)."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None,
                 attention_chunk_size: int | None = None) -> None:
        """`logits_soft_cap`: scores become `cap * tanh(scores / cap)` before the softmax
        (Gemma 2); a backend without `supports_logits_soft_cap` refuses it.

        `sinks` [num_heads] float32, on the layer's device: attention sinks (gpt-oss), one
        learned logit per query head that joins every softmax's denominator and adds no value,
        so each row's weights sum to less than one. The layer owns the tensor and loads it in
        place; a backend without `supports_attention_sinks` refuses it.

        `attention_chunk_size` C: the sequence is cut into chunks of C positions and a token
        at position p sees only keys in [p - p % C, p] (Llama 4's chunked layers); a backend
        without `supports_chunked_attention` refuses it.

        The layer passes `sinks` and `attention_chunk_size` only when set, so a backend written
        before them need not take them."""
        if logits_soft_cap is not None and not self.supports_logits_soft_cap:
            raise ValueError(f"attention backend {self.name} has no logit soft-capping, which "
                             f"this model needs; torch_paged and cpu_paged have it")
        if sinks is not None and not self.supports_attention_sinks:
            raise ValueError(f"attention backend {self.name} has no attention sinks, which "
                             f"this model needs; torch_paged, cpu_paged and triton_paged have "
                             f"them")
        if attention_chunk_size is not None and not self.supports_chunked_attention:
            raise ValueError(f"attention backend {self.name} has no chunked attention "
                             f"(attention_chunk_size), which this model needs; torch_paged "
                             f"and cpu_paged have it")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.sinks = sinks
        self.attention_chunk_size = attention_chunk_size
        # float32 scalars on the default device, which is the layer's: the engine (and
        # `runtime.testing.paged_batch`) build layers under `torch.device(device)`. Updated in
        # place, so a recorded device graph reads the current values.
        self.k_scale = torch.ones((), dtype=torch.float32)
        self.v_scale = torch.ones((), dtype=torch.float32)

    def set_kv_scales(self, k_scale: float | None = None, v_scale: float | None = None) -> None:
        """Set the FP8 cache scales (a checkpoint's); a scale left None keeps its value."""
        for scale, value in ((self.k_scale, k_scale), (self.v_scale, v_scale)):
            if value is None:
                continue
            if not value > 0 or value == float("inf"):
                raise ValueError(f"a KV-cache scale must be a positive finite number, got {value}")
            scale.fill_(value)

    def calculate_kv_scales(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """`--calculate-kv-scales`: the scales that map this batch's largest |K| and |V| to
        K_SCALE_RANGE and V_SCALE_RANGE (1.0 where they are all zero)."""
        for scale, x, top in ((self.k_scale, key, K_SCALE_RANGE),
                              (self.v_scale, value, V_SCALE_RANGE)):
            amax = x.detach().abs().max().float()
            scale.copy_(torch.where(amax > 0, amax / top, 1.0))

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Write this step's K/V into `kv_cache` at `metadata.slot_mapping`, then attend.

        query [num_tokens, num_heads, head_size]; key/value [num_tokens, num_kv_heads, head_size].
        Each token attends causally to its own request's context (and only the last
        `sliding_window` positions, or only its own chunk of `attention_chunk_size` positions,
        when set; with `sinks`, each head's sink logit joins the softmax; a query inside one
        of its request's `mm_prefix_ranges` also sees that range's later keys, the sliding
        window still applying); a `prefill_only` step
        leaves the cache untouched,
        and with `causal` False each token attends to every token of its request.
        Returns [num_tokens, num_heads, head_size].
        """

    def forward_with_lse(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: torch.Tensor,
                         metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode context parallel (`metadata.dcp` set): write the tokens this rank keeps
        (`slot_mapping` >= 0), then attend over this rank's shard of each context alone.

        query [num_tokens, num_heads, head_size] holds the heads of the whole DCP group (it
        shares this rank's KV heads). Returns the partial output [num_tokens, num_heads,
        head_size] and its log-sum-exp [num_tokens, num_heads] float32 (a query that sees no
        key here: output 0, LSE -inf), for `context_parallel.merge_attn_states`.
        """
        raise NotImplementedError(f"attention backend {self.name} cannot return the "
                                  f"log-sum-exp decode context parallel merges by")


class MLAAttentionBackend(AttentionBackend):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over a paged latent cache.

    Per token the cache holds one vector of `kv_lora_rank + qk_rope_head_dim`: the normalised
    KV latent `kv_c` then the rotated shared key part `k_pe`, instead of K and V per head.
    `kv_b_weight` [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] is this rank's
    rows of the model's `kv_b_proj` (per head: W_UK's `qk_nope_head_dim` rows, then W_UV's
    `v_head_dim`); the backend keeps views of it, so it may be filled after construction.

    Prefill may decompress the context's K/V from the latent; decode runs absorbed: the query
    becomes `q_nope @ W_UK` (kv_lora_rank wide) next to `q_pe`, attends over the cached latents
    as one shared KV head (scores over the whole vector, values its first `kv_lora_rank`), and
    W_UV maps the result to `v_head_dim` per head. `scale` multiplies the full q.k score.
    """

    kind = "mla"
    kv_cache_block_dim = 0

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        """[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (`num_kv_heads` is 1)."""
        return (num_blocks, block_size, head_size)

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float,
                 kv_b_weight: torch.Tensor) -> None:
        super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, scale, 1)
        self.kv_lora_rank, self.v_head_dim = kv_lora_rank, v_head_dim
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.kv_b_weight = kv_b_weight
        w = kv_b_weight.view(num_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank)
        self.w_uk = w[:, :qk_nope_head_dim]  # [H, Dn, L]
        self.w_uv = w[:, qk_nope_head_dim:]  # [H, Dv, L]

    @abstractmethod
    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Write this step's latents (`kv_c` [T, kv_lora_rank] and `k_pe` [T, rope]) at
        `metadata.slot_mapping`, then attend causally within each request.

        q_nope [T, H, qk_nope_head_dim], q_pe [T, H, qk_rope_head_dim] (rotated).
        Returns [T, H, v_head_dim].
        """
