"""The conformance suite's attention check catches each kind of broken backend, with a message
that shows the mismatch; a correct backend written differently passes it."""
import math

import pytest
import torch

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata
from runtime.testing.attention_check import CASES, check_attention

BUGS = ("hard-coded-scale", "bf16-only", "no-soft-cap", "no-window", "wrong-gqa",
        "no-cache-write")


class NaiveAttention(AttentionBackend):
    """Paged attention the obvious way, request by request, in float32; `bug` breaks one thing."""

    name = "naive"
    supports_logits_soft_cap = True
    bug: str | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        block_size = kv_cache.size(2)
        k_cache, v_cache = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)
        if self.bug != "no-cache-write":
            k_cache[metadata.slot_mapping] = key
            v_cache[metadata.slot_mapping] = value
        heads = torch.arange(self.num_heads)
        group = self.num_heads // self.num_kv_heads
        kv_heads = heads % self.num_kv_heads if self.bug == "wrong-gqa" else heads // group
        scale = self.head_size ** -0.5 if self.bug == "hard-coded-scale" else self.scale
        cap = None if self.bug == "no-soft-cap" else self.logits_soft_cap
        window = None if self.bug == "no-window" else self.sliding_window
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            blocks = metadata.block_tables[i, :math.ceil(seq_len / block_size)].long()
            slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:seq_len]
            k = k_cache[slots][:, kv_heads].float()
            v = v_cache[slots][:, kv_heads].float()
            if self.bug == "bf16-only" and query.dtype == torch.bfloat16:
                v = k  # a bf16 code path that reads the wrong half of the cache
            q = query[starts[i]:starts[i + 1]].float()
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            q_pos = torch.arange(seq_len - q.size(0), seq_len)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        return out


def broken(bug: str | None) -> type[AttentionBackend]:
    return type(f"Naive_{bug}", (NaiveAttention,), {"bug": bug, "name": f"naive ({bug})"})


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_correct_backend_passes(dtype, case):
    check_attention(broken(None), dtype, "cpu", CASES[case])


# bug -> (dtype and case that show it, what the message must name)
CAUGHT = {
    "hard-coded-scale": (torch.float32, "scale", "scale 0.37"),
    "bf16-only": (torch.bfloat16, "scale", "bfloat16"),
    "no-soft-cap": (torch.float32, "soft-cap", "logits_soft_cap 1.5"),
    "no-window": (torch.float32, "sliding-window", "sliding_window 12"),
    "wrong-gqa": (torch.float32, "scale", "8 query heads over 2 KV heads"),
    "no-cache-write": (torch.float32, "scale", "KV cache"),
}


@pytest.mark.parametrize("bug", BUGS)
def test_each_broken_backend_fails_with_the_mismatch(bug):
    dtype, case, named = CAUGHT[bug]
    with pytest.raises(AssertionError) as failure:
        check_attention(broken(bug), dtype, "cpu", CASES[case])
    message = str(failure.value)
    assert f"naive ({bug})" in message and named in message, message
    assert " values outside atol = rtol = " in message and "got " in message \
        and "want " in message, message


def test_the_bf16_bug_needs_the_bf16_run():
    check_attention(broken("bf16-only"), torch.float32, "cpu", CASES["scale"])
