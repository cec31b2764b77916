"""Decode context parallel in the Triton paged-attention kernels: each rank's partial output and
log-sum-exp over its shard equal the portable torch backend's, and the ranks' partials merge to
attention over the whole context; split decodes too.

Without a GPU the kernels run through Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py); on a GPU (tests/device/run.sh) they are compiled. Sizes stay tiny.
"""
import pytest
import torch

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not triton.knobs.runtime.interpret:
    pytest.skip("no GPU, and Triton was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

from runtime.attention_backends import triton_ops  # noqa: E402
from runtime.attention_backends.base import AttentionMetadata  # noqa: E402
from runtime.attention_backends.context_parallel import (ContextParallel,  # noqa: E402
                                                         merge_attn_states)
from runtime.attention_backends.torch_paged import TorchPagedAttention  # noqa: E402
from runtime.attention_backends.triton_paged import TritonPagedAttention  # noqa: E402
from runtime.testing.paged_batch import build_layer  # noqa: E402

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 16, 4
# decodes first (one of a 2-token context: at 4 ranks, or 2 with interleave 2, some ranks
# hold none of it), then a chunk after a cached prefix and a whole prompt
MIXED = ([1, 1, 1, 5, 9], [23, 2, 40, 30, 9])
DECODES = ([1, 1, 1], [2, 17, 40])
# decodes long enough for the kernel to split them along the context at 2 ranks
LONG_DECODES = ([1, 1, 1], [1, 700, 1300])


class Step:
    """A step's tensors and the whole contexts' K/V, built once for every rank."""

    def __init__(self, query_lens: list[int], seq_lens: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.query_lens, self.seq_lens = query_lens, seq_lens
        self.keys = [torch.randn(n, KV_HEADS, HEAD_SIZE, generator=gen) for n in seq_lens]
        self.values = [torch.randn(n, KV_HEADS, HEAD_SIZE, generator=gen) for n in seq_lens]
        self.query = torch.randn(sum(query_lens), HEADS, HEAD_SIZE, generator=gen)
        self.key = torch.cat([k[n - q:] for k, q, n in zip(self.keys, query_lens, seq_lens)])
        self.value = torch.cat([v[n - q:] for v, q, n in zip(self.values, query_lens, seq_lens)])
        # each request's blocks, shuffled so that the tables matter
        self.per_req = -(-max(seq_lens) // BLOCK_SIZE)
        self.tables = torch.randperm(len(seq_lens) * self.per_req, generator=gen).view(
            len(seq_lens), self.per_req).int()

    def shard(self, cp: ContextParallel, written: bool = False
              ) -> tuple[torch.Tensor, AttentionMetadata]:
        """This rank's cache (its share of every context before the step, or after it when
        `written`) and the step's metadata: slots -1 for the tokens other ranks keep, block
        tables as wide as the shards need (blocks of BLOCK_SIZE x world tokens), as the
        engine's are."""
        tables = self.tables[:, :-(-max(self.seq_lens) // (BLOCK_SIZE * cp.world_size))]
        cache = torch.zeros(2, self.tables.numel(), BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
        flat = cache.view(2, -1, KV_HEADS, HEAD_SIZE)
        slots = []
        for i, (q_len, seq_len) in enumerate(zip(self.query_lens, self.seq_lens)):
            pos = torch.arange(seq_len)
            local = cp.local_index(pos)
            slot = tables[i, local // BLOCK_SIZE].long() * BLOCK_SIZE + local % BLOCK_SIZE
            slot[cp.owner(pos) != cp.rank] = -1
            cached = seq_len if written else seq_len - q_len
            kept = slot[:cached] >= 0
            flat[0, slot[:cached][kept]] = self.keys[i][:cached][kept]
            flat[1, slot[:cached][kept]] = self.values[i][:cached][kept]
            slots.append(slot[seq_len - q_len:])
        starts = [0]
        for q_len in self.query_lens:
            starts.append(starts[-1] + q_len)
        metadata = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(DEVICE),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=tables.contiguous().to(DEVICE), query_start_loc_cpu=starts,
            seq_lens_cpu=list(self.seq_lens), max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens),
            num_decode_tokens=sum(q == 1 for q in self.query_lens), dcp=cp)
        return cache.to(DEVICE), metadata

    def run(self, backend, cp: ContextParallel, **layer_args):
        """(output, LSE, cache after the step) of `backend` on rank `cp`, on the host."""
        cache, metadata = self.shard(cp)
        layer = build_layer(backend, DEVICE, HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS,
                            **layer_args)
        out, lse = layer.forward_with_lse(self.query.to(DEVICE), self.key.to(DEVICE),
                                          self.value.to(DEVICE), cache, metadata)
        return out.cpu(), lse.cpu(), cache.cpu()

    def full_attention(self, **layer_args) -> torch.Tensor:
        """The torch backend's attention over the whole (unsharded) contexts."""
        cache, metadata = self.shard(ContextParallel())
        layer = build_layer(TorchPagedAttention, DEVICE, HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5,
                            KV_HEADS, **layer_args)
        return layer.forward(self.query.to(DEVICE), self.key.to(DEVICE), self.value.to(DEVICE),
                             cache, metadata).cpu()


def check_ranks(step: Step, world: int, interleave: int, **layer_args) -> None:
    """Every rank's (output, LSE) and written cache from Triton equal torch's; the merge of the
    ranks' partials equals full attention."""
    outs, lses = [], []
    for rank in range(world):
        cp = ContextParallel(rank, world, interleave)
        out, lse, cache = step.run(TritonPagedAttention, cp, **layer_args)
        want_out, want_lse, _ = step.run(TorchPagedAttention, cp, **layer_args)
        torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)  # -inf where both are
        assert torch.equal(cache, step.shard(cp, written=True)[0].cpu())  # only its own tokens
        assert not out.isnan().any()
        assert out[lse == float("-inf")].eq(0).all()  # rows that saw no key here
        outs.append(out)
        lses.append(lse)
    merged = merge_attn_states(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, step.full_attention(**layer_args), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("lens,world,interleave", [
    (MIXED, 2, 1), (MIXED, 2, 2), (MIXED, 4, 1), (MIXED, 4, 2), (DECODES, 4, 2),
    (DECODES, 1, 1)], ids=["mixed-2x1", "mixed-2x2", "mixed-4x1", "mixed-4x2", "decodes-4x2",
                           "decodes-1x1"])
def test_ranks_match_the_torch_backend(lens, world, interleave):
    check_ranks(Step(*lens), world, interleave)


def test_a_short_context_leaves_a_rank_empty():
    """The 2-token decode at 4 ranks: ranks 2 and 3 see no key of it (LSE -inf, output 0)."""
    step = Step(*DECODES)
    for rank in (2, 3):
        out, lse, _ = step.run(TritonPagedAttention, ContextParallel(rank, 4, 1))
        assert lse[0].eq(float("-inf")).all() and out[0].eq(0).all()
        assert lse[1:].isfinite().all()


@pytest.mark.parametrize("world,interleave,extra", [
    (4, 1, dict(sliding_window=7)), (2, 2, dict(attention_chunk_size=8))],
    ids=["window-4x1", "chunked-2x2"])
def test_windows_and_chunks_at_real_positions(world, interleave, extra):
    check_ranks(Step(*MIXED), world, interleave, **extra)


def test_fp8_cache():
    """An e4m3 cache with scales: the kernels encode and decode it as torch does."""
    step = Step(*MIXED)
    for rank in range(2):
        cp = ContextParallel(rank, 2, 1)
        got = []
        for backend in (TritonPagedAttention, TorchPagedAttention):
            cache, metadata = step.shard(cp)
            layer = build_layer(backend, DEVICE, HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS)
            layer.set_kv_scales(0.02, 0.05)
            got.append(layer.forward_with_lse(step.query.to(DEVICE), step.key.to(DEVICE),
                                              step.value.to(DEVICE),
                                              cache.to(torch.float8_e4m3fn), metadata))
        for g, w in zip(*got):
            torch.testing.assert_close(g.cpu(), w.cpu(), atol=2e-5, rtol=2e-5)


@pytest.fixture
def merges(monkeypatch) -> list[tuple[int, int]]:
    """The grid of every merge of split decodes."""
    grids: list[tuple[int, int]] = []
    merge = triton_ops._merge_splits_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return merge[grid]

    monkeypatch.setattr(triton_ops, "_merge_splits_kernel", Spy())
    return grids


@pytest.mark.parametrize("interleave,window", [(1, None), (2, 300)])
def test_split_decode(merges, interleave, window):
    """Long decodes at 2 ranks are cut into pieces of the shard (the 1-token context's pieces,
    and every piece of it on rank 1, see nothing): the merge writes the rows' LSE."""
    check_ranks(Step(*LONG_DECODES), 2, interleave, sliding_window=window)
    assert merges == [(3, HEADS)] * 2  # each rank's decodes were split


def test_sinks_are_refused():
    step = Step(*DECODES)
    cache, metadata = step.shard(ContextParallel(0, 2, 1))
    layer = build_layer(TritonPagedAttention, DEVICE, HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5,
                        KV_HEADS, sinks=torch.zeros(HEADS, device=DEVICE))
    with pytest.raises(ValueError, match="does not merge attention sinks"):
        layer.forward_with_lse(step.query.to(DEVICE), step.key.to(DEVICE),
                               step.value.to(DEVICE), cache, metadata)
