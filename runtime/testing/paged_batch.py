"""Random mixed batches over a paged KV cache, for checking attention backends against each other."""
from __future__ import annotations

import torch

from runtime.attention_backends.base import AttentionMetadata


def make_batch(query_lens: list[int], seq_lens: list[int], block_size: int, num_heads: int,
               num_kv_heads: int, head_size: int, dtype: torch.dtype = torch.float32,
               device: str = "cpu", seed: int = 0):
    """A flat batch (decodes first, as the model runner orders it) over a cache whose blocks are
    handed out in shuffled order and pre-filled with the requests' earlier context.

    Returns (query, key, value, kv_cache, metadata).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # a few never-used blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    slots = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        ids = [order.pop() for _ in range(blocks_per_req[i])]
        tables[i, :len(ids)] = torch.tensor(ids)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen)
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    decodes = next((i for i, q in enumerate(query_lens) if q > 1), len(query_lens))
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), num_decode_tokens=decodes)
    to = dict(device=device, dtype=dtype)
    return query.to(**to), key.to(**to), value.to(**to), kv_cache.to(**to), metadata


def head_major(backend_cls) -> bool:
    """Whether `backend_cls` stores its cache head-major, [2, num_blocks, num_kv_heads,
    block_size, head_size], rather than token-major, [2, num_blocks, block_size, num_kv_heads,
    head_size] (the layout these helpers build); any other layout is refused."""
    shape = tuple(backend_cls.kv_cache_shape(1, 2, 3, 4))
    if shape not in ((2, 1, 2, 3, 4), (2, 1, 3, 2, 4)):
        raise ValueError(f"{backend_cls.__name__} stores a cache in a layout these helpers do "
                         f"not convert: {shape} for 1 block of 2 tokens, 3 heads of 4")
    return shape == (2, 1, 3, 2, 4)


def in_layout(backend_cls, cache: torch.Tensor) -> torch.Tensor:
    """A copy of a token-major cache in `backend_cls`'s own layout."""
    return cache.transpose(2, 3).contiguous() if head_major(backend_cls) else cache.clone()


def token_major(backend_cls, cache: torch.Tensor) -> torch.Tensor:
    """A cache in `backend_cls`'s layout seen token-major (a view; the inverse of `in_layout`)."""
    return cache.transpose(2, 3) if head_major(backend_cls) else cache


def build_layer(backend_cls, device: str | torch.device, *args, **kwargs):
    """`backend_cls(*args, **kwargs)` built on `device`, as the engine builds its layers, so the
    layer's own tensors (the FP8 `k_scale`/`v_scale`) live where its inputs do."""
    with torch.device(device):
        return backend_cls(*args, **kwargs)


def run_backend(backend_cls, batch, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's forward on a copy of the batch's cache (in the backend's layout), the layer
    built on the batch's device (with attention `sinks` [num_heads], if given); returns
    (output, cache after, token-major)."""
    query, key, value, kv_cache, metadata = batch
    num_heads, head_size = query.shape[1:]
    impl = build_layer(backend_cls, query.device, num_heads, head_size, head_size ** -0.5,
                       key.shape[1], sliding_window, None, sinks)
    cache = in_layout(backend_cls, kv_cache)
    return impl.forward(query, key, value, cache, metadata), token_major(backend_cls, cache)


def run_two_steps(backend_cls, query_lens: list[int], seq_lens: list[int], block_size: int,
                  num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                  device: str | torch.device, sliding_window: int | None = None,
                  seed: int = 0, scale: float | None = None,
                  logits_soft_cap: float | None = None,
                  input_dtype: torch.dtype | None = None,
                  kv_cache_dtype: torch.dtype | None = None,
                  attention_chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one layer of `backend_cls` for two steps over a cache in the backend's own layout.

    Step 1 prefills each request's earlier context (writing it through the backend), step 2
    runs the batch of new tokens (`query_lens`, decodes first) reading it back. Works for any
    cache layout a backend declares. `scale` defaults to head_size ** -0.5; the random inputs
    are rounded through `input_dtype` (default `dtype`) first, so a float32 reference can see
    exactly the values a bf16 run sees. The cache is kept in `kv_cache_dtype` (default `dtype`;
    an FP8 one with the layer's scales at 1.0). Returns both steps' outputs, on the CPU in
    float32.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    width = max(map(len, tables))
    qkv = [torch.randn(s, num_heads + 2 * num_kv_heads, head_size, generator=gen)
           .to(input_dtype or dtype).float() for s in seq_lens]
    scale = head_size ** -0.5 if scale is None else scale
    chunked = {} if attention_chunk_size is None else {
        "attention_chunk_size": attention_chunk_size}
    impl = build_layer(backend_cls, device, num_heads, head_size, scale, num_kv_heads,
                       sliding_window, logits_soft_cap, **chunked)
    cache = torch.zeros(backend_cls.kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                                   head_size), dtype=kv_cache_dtype or dtype,
                        device=device)
    context = [(i, 0, s - q) for i, (q, s) in enumerate(zip(query_lens, seq_lens)) if s > q]
    context.sort(key=lambda c: c[2] > 1)  # one-token requests first
    new = [(i, s - q, s) for i, (q, s) in enumerate(zip(query_lens, seq_lens))]
    outs = []
    for step in (context, new):
        if not step:
            outs.append(torch.empty(0))
            continue
        rows = torch.cat([qkv[i][lo:hi] for i, lo, hi in step]).to(device=device, dtype=dtype)
        q, k, v = rows.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        slots = [tables[i][p // block_size] * block_size + p % block_size
                 for i, lo, hi in step for p in range(lo, hi)]
        starts = [0]
        for _, lo, hi in step:
            starts.append(starts[-1] + hi - lo)
        lens = [hi for _, _, hi in step]
        qlens = [hi - lo for _, lo, hi in step]
        table = torch.zeros(len(step), width, dtype=torch.int32)
        for row, (i, _, _) in enumerate(step):
            table[row, :len(tables[i])] = torch.tensor(tables[i])
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_tables=table.to(device), query_start_loc_cpu=starts, seq_lens_cpu=lens,
            max_query_len=max(qlens), max_seq_len=max(lens),
            num_decode_tokens=next((j for j, n in enumerate(qlens) if n > 1), len(qlens)))
        outs.append(impl.forward(q.contiguous(), k.contiguous(), v.contiguous(), cache, md)
                    .float().cpu())
    return outs[0], outs[1]
