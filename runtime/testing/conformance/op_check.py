"""A custom op, as the engine builds it for a platform, checked against the portable op on inputs
where every term of the op matters: ordinary rows, zero rows (padding), tiny and huge
magnitudes, rows that are not contiguous, sizes no vector width divides."""
from __future__ import annotations

from typing import Callable

import torch

from runtime.plugins.answers import PlatformAnswers
from runtime.plugins.interfaces import Platform
from runtime.plugins.ops import (COMPOSITES, add_rms_norm, gated_rms_norm, rms_norm,
                                 rotary_embedding, silu_and_mul)

PORTABLE = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "silu_and_mul": silu_and_mul,
            "rotary_embedding": rotary_embedding, "gated_rms_norm": gated_rms_norm}
EPS = 1e-5  # not the usual 1e-6, so a hard-coded eps shows
# rtol per dtype, about two units in the last place; atol is rtol times the case's largest value
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9}


def resolve(platform: Platform, name: str) -> tuple[Callable | None, str]:
    """The op a model's layers run for `name` on `platform` (None: the portable one), and who
    supplied it: a composite no plugin supplies whole is built from its registered part, as the
    layers build it."""
    answers = PlatformAnswers(platform)
    op = answers.custom_op(name)
    who = answers.records["runtime_custom_op", name].answered_by
    if op is None and name in COMPOSITES and who:
        part, compose = COMPOSITES[name]
        return compose(answers.custom_op(part)), who  # "composed from rms_norm (<supplier>)"
    return op, f"{getattr(op, '__qualname__', type(op).__name__)}, answered by {who}"


def cases(name: str, dtype: torch.dtype, device) -> dict[str, tuple]:
    """Inputs for op `name`, by what they exercise, built on the CPU in float32 then moved."""
    gen = torch.Generator().manual_seed(0)
    big = 200.0 if dtype == torch.float16 else 1e4  # float16: x² overflows unless upcast

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype)

    if name in ("rms_norm", "add_rms_norm"):
        shapes = {"ordinary rows [7, 64]": randn(7, 64),
                  "zero rows (padding)": torch.zeros(3, 64),
                  "tiny rows (|x| ~ 1e-4: the mean square is below eps)": randn(5, 64) * 1e-4,
                  f"huge rows (|x| ~ {big:g})": randn(5, 64) * big,
                  "rows of a wider tensor (row stride 96, not 64)": randn(7, 96),
                  "an odd hidden size (5 rows of 67)": randn(5, 67)}
        made = {}
        for what, x in shapes.items():
            x = rows(x)
            x = x[:, 16:80] if "stride" in what else x
            weight = rows(randn(x.size(-1)) + 1)
            residual = rows(randn(*x.shape) * (x.abs().max().item() or 1))
            made[what] = (x, weight, EPS) if name == "rms_norm" else (x, residual, weight, EPS)
        return made
    if name == "silu_and_mul":
        return {"ordinary rows [7, 128]": (rows(randn(7, 128)),),
                "zero rows (padding)": (rows(torch.zeros(3, 128)),),
                "tiny rows (|x| ~ 1e-4)": (rows(randn(5, 128) * 1e-4),),
                f"huge rows (|x| ~ {big / 2:g})": (rows(randn(5, 128) * big / 2),),
                "rows of a wider tensor (row stride 160, not 128)":
                    (rows(randn(7, 160))[:, 16:144],),
                "an odd width (5 rows of 2 x 67)": (rows(randn(5, 134)),)}
    if name == "rotary_embedding":
        def rope(tokens: int, rotary_dim: int, sliced: bool) -> tuple:
            positions = torch.randint(0, 32, (tokens,), generator=gen).to(device)
            qkv = rows(randn(tokens, 8 * 64))
            q, k = (qkv[:, :256], qkv[:, 256:384]) if sliced else \
                (qkv[:, :256].contiguous(), qkv[:, 256:384].contiguous())
            return positions, q, k, randn(32, rotary_dim).to(device), 64
        return {"7 tokens, 4 query and 2 key heads of 64": rope(7, 64, False),
                "one token": rope(1, 64, False),
                "query and key sliced out of one qkv tensor (not contiguous)": rope(7, 64, True),
                "partial rotary (32 of 64 dims)": rope(5, 32, False)}
    if name == "gated_rms_norm":
        def gated(x: torch.Tensor, group: int, before: bool, shared: bool = False,
                  sliced: bool = False) -> tuple:
            t, width = x.shape
            projected = rows(randn(t, 2 * width + 40) * 3)  # the gate, as in_proj's split gives it
            gate = projected[:, :width] if sliced else projected[:, :width].contiguous()
            weight = rows(randn(group if shared else width) + 1)
            return rows(x), gate, weight, EPS, group, before
        return {"norm after the gate, 4 groups of 32 [7, 128]": gated(randn(7, 128), 32, False),
                "norm before the gate, 4 heads of 64 sharing one weight [64]":
                    gated(randn(7, 256), 64, True, shared=True),
                "zero rows (padding)": gated(torch.zeros(3, 128), 32, False),
                "tiny rows (|x| ~ 1e-4: the mean square is below eps)":
                    gated(randn(5, 128) * 1e-4, 32, True),
                f"huge rows (|x| ~ {big / 10:g})": gated(randn(5, 128) * big / 10, 32, False),
                "a gate sliced out of the input projection (row stride 296, not 128)":
                    gated(randn(7, 128), 32, False, sliced=True),
                "an odd group size (3 groups of 20)": gated(randn(5, 60), 20, True)}
    raise KeyError(name)


def check_op(op: Callable, who: str, name: str, dtype: torch.dtype, device) -> None:
    """Raise AssertionError, saying which case differs from the portable op `name`, where, by
    how much and, where known, which bug it matches."""
    label = f"{name} ({who}), {str(dtype).removeprefix('torch.')}"
    for what, args in cases(name, dtype, device).items():
        want = host(PORTABLE[name](*args))
        got = host(op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
        problem = difference(got, want, dtype)
        if problem:
            raise AssertionError(f"{label}, on {what}: {problem}"
                                 + "".join(f"\n  diagnosis: {d}" for d in diagnose(
                                     name, args, got, dtype)))


def host(out) -> tuple[torch.Tensor, ...]:
    return tuple(o.float().cpu() for o in (out if isinstance(out, tuple) else (out,)))


def difference(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...],
               dtype: torch.dtype) -> str | None:
    """Where the outputs differ beyond rtol, atol = rtol x the largest value (NaN matches only
    NaN), or None."""
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        return (f"outputs of shapes {[tuple(g.shape) for g in got]}, expected "
                f"{[tuple(w.shape) for w in want]}")
    rtol = RTOL.get(dtype, 2 ** -7)
    for i, (g, w) in enumerate(zip(got, want)):
        atol = rtol * max(w.nan_to_num(0.0).abs().max().item(), torch.finfo(torch.float32).tiny)
        bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
        if bad.any():
            error = (g - w).abs().nan_to_num(float("inf")).masked_fill(~bad, 0)
            at = tuple(int(j) for j in torch.unravel_index(error.argmax(), g.shape))
            which = f"output {i}: " if len(got) > 1 else ""
            return (f"{which}{int(bad.sum())} of {bad.numel()} values differ beyond rtol "
                    f"{rtol:g}, atol {atol:.3g}; the worst at {list(at)}: got {g[at]:.6g}, "
                    f"want {w[at]:.6g}")
    return None


def diagnose(name: str, args: tuple, got: tuple[torch.Tensor, ...],
             dtype: torch.dtype) -> list[str]:
    """The known bugs the output matches: for the norms, an eps ignored or hard-coded."""
    if name not in ("rms_norm", "add_rms_norm"):
        return []
    found = []
    for eps, text in ((0.0, f"it matches {name} with eps = 0: the op ignores eps (it must "
                            f"compute x / sqrt(mean(x²) + eps))"),
                      (1e-6, f"it matches {name} with eps = 1e-06: the op uses a fixed eps, not "
                             f"the eps it is passed ({EPS:g})")):
        want = host(PORTABLE[name](*args[:-1], eps))
        if difference(got, want, dtype) is None:
            found.append(text)
    return found
