"""An MLA attention backend checked against float32 multi-head latent attention math.

The batch and its two steps are the attention check's (`runtime.testing.attention_check`):
decodes, prefill chunks after a cached context and first-step prefills over a paged cache with
shuffled blocks. The reference never absorbs: it decompresses every position's K and V from the
latent through `kv_b_proj` and runs plain causal attention per head in float32, so a backend
whose absorbed decode folds W_UK or W_UV wrongly, reads the wrong latent slice, or writes the
cache at the wrong slots shows as the kind of row that differs. Half-precision tolerances are
derived as the attention check's: the reference is also computed as a correct absorbed kernel
in that dtype rounds (latent query, probabilities, latent output and output rounded).
"""
from __future__ import annotations

import torch

from runtime.testing.attention_check import (BLOCK_SIZE, FLOAT32_TOLERANCE, ROUNDING_FACTOR,
                                             SEQ_LENS, STEPS, Rows, describe_rows, kinds,
                                             metadata, rounding_error, step_rows, token_index)

NUM_HEADS, KV_LORA_RANK, ROPE, NOPE, V_HEAD = 8, 64, 16, 32, 24
LATENT = KV_LORA_RANK + ROPE
SCALE = 0.3  # not (NOPE + ROPE) ** -0.5, so a backend that ignores `scale` shows


def make_inputs(dtype: torch.dtype, seed: int = 0):
    """Per request [seq_len, ...] rows of q_nope, q_pe, kv_c, k_pe; the kv_b_proj weight; the
    block tables over a shuffled pool. All rounded through `dtype`, held in float32."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in SEQ_LENS) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in SEQ_LENS]

    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype).float()

    seqs = [(rand(s, NUM_HEADS, NOPE), rand(s, NUM_HEADS, ROPE), rand(s, KV_LORA_RANK),
             rand(s, ROPE)) for s in SEQ_LENS]
    kv_b = rand(NUM_HEADS * (NOPE + V_HEAD), KV_LORA_RANK, std=KV_LORA_RANK ** -0.5)
    return seqs, kv_b, tables


def reference(seqs, kv_b: torch.Tensor, rows: list[Rows],
              rounding: torch.dtype | None = None) -> torch.Tensor:
    """[tokens, heads, v_head_dim] float32: decompressed attention (`rounding` None), or the
    absorbed computation rounded as a `rounding`-dtype kernel rounds."""
    w = kv_b.view(NUM_HEADS, NOPE + V_HEAD, KV_LORA_RANK)
    w_uk, w_uv = w[:, :NOPE], w[:, NOPE:]

    def rnd(x: torch.Tensor) -> torch.Tensor:
        return x if rounding is None else x.to(rounding).float()

    outs = []
    for r in rows:
        q_nope, q_pe, kv_c, k_pe = (x[:r.first + r.count] for x in seqs[r.request])
        q_nope, q_pe = q_nope[r.first:], q_pe[r.first:]
        if rounding is None:
            k = torch.cat((torch.einsum("sl,hdl->shd", kv_c, w_uk),
                           k_pe[:, None].expand(-1, NUM_HEADS, -1)), -1)
            v = torch.einsum("sl,hdl->shd", kv_c, w_uv)
            scores = torch.einsum("qhd,khd->hqk", torch.cat((q_nope, q_pe), -1), k) * SCALE
        else:
            q_latent = rnd(torch.einsum("qhd,hdl->qhl", q_nope, w_uk))
            scores = (torch.einsum("qhl,kl->hqk", q_latent, kv_c)
                      + torch.einsum("qhr,kr->hqk", q_pe, k_pe)) * SCALE
        q_pos = torch.arange(r.first, r.first + r.count)[:, None]
        mask = torch.arange(r.first + r.count)[None, :] <= q_pos
        probs = rnd(scores.masked_fill(~mask, float("-inf")).softmax(-1))
        if rounding is None:
            outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        else:
            o_latent = rnd(torch.einsum("hqk,kl->qhl", probs, kv_c))
            outs.append(rnd(torch.einsum("qhl,hdl->qhd", o_latent, w_uv)))
    return torch.cat(outs)


def run_steps(backend: type, seqs, kv_b: torch.Tensor, tables, dtype: torch.dtype,
              device) -> list[torch.Tensor]:
    """Both steps through one layer of `backend`: each step's output, on the CPU in float32."""
    weight = kv_b.to(device=device, dtype=dtype)
    impl = backend(NUM_HEADS, KV_LORA_RANK, NOPE, ROPE, V_HEAD, SCALE, weight)
    num_blocks = sum(map(len, tables)) + 2
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, BLOCK_SIZE, 1, LATENT), dtype=dtype,
                        device=device)
    results = []
    for rows in step_rows():
        parts = [torch.cat([seqs[r.request][i][r.first:r.first + r.count] for r in rows])
                 .to(device=device, dtype=dtype) for i in range(4)]
        out = impl.forward(*parts, cache, metadata(rows, tables, device))
        results.append(out.float().cpu())
    return results


def check_mla_attention(backend: type, dtype: torch.dtype, device: str | torch.device,
                        label: str = "") -> None:
    """Raise AssertionError, naming the step, the kind of row and the worst value, when
    `backend` differs from float32 MLA math beyond the dtype's tolerance."""
    seqs, kv_b, tables = make_inputs(dtype)
    results = run_steps(backend, seqs, kv_b, tables, dtype, device)
    for step, (rows, got) in enumerate(zip(step_rows(), results)):
        want = reference(seqs, kv_b, rows)
        if got.shape != want.shape:
            raise AssertionError(f"MLA backend {label or backend.name}: output shape "
                                 f"{tuple(got.shape)}, expected {tuple(want.shape)}")
        bound = None if dtype == torch.float32 else rounding_error(
            reference(seqs, kv_b, rows, dtype), want, rows, dtype)
        ok = (torch.isclose(got, want, atol=FLOAT32_TOLERANCE, rtol=FLOAT32_TOLERANCE)
              if bound is None else (got - want).abs() <= ROUNDING_FACTOR * bound)
        failing = []
        for kind in kinds(rows):
            index = token_index(rows, kind)
            if not ok[index].all():
                worst = (got[index] - want[index]).abs().nan_to_num(float("inf")).max()
                failing.append(f"  ✗ {kind} ({describe_rows(rows, kind)}): "
                               f"{int((~ok[index]).sum())} of {ok[index].numel()} values "
                               f"differ, the worst by {worst:.3g}")
        if failing:
            raise AssertionError(
                f"MLA backend {label or backend.name} differs from float32 MLA math in "
                f"{STEPS[step]}, {str(dtype).removeprefix('torch.')}, {NUM_HEADS} heads, "
                f"kv_lora_rank {KV_LORA_RANK}, rope {ROPE}, scale {SCALE}:\n"
                + "\n".join(failing))
