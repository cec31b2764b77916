"""An attention backend checked against float32 attention math, with a report that names the bug.

The batch mixes decodes and prefill chunks over a paged cache whose blocks are out of order, with
more query heads than KV heads, and runs in two steps: step 1 prefills each request's earlier
context, writing it through the backend; step 2 runs decodes, a prefill chunk after that context
and a first-step prefill together, reading the context back from the cache. Each step's output is
compared per kind of row and per query head with the attention of the very same (rounded) inputs
in float32. On a mismatch the check runs cheap diagnoses (was the cache written at the step's
slots? does the output match attention over one position fewer or more, over another KV-head
mapping, at the default scale, without the soft-cap, the attention sinks or the image ranges,
with a window one wider or narrower?) and names the one that matches.

Half-precision tolerances are derived, not flat: the reference is also computed as a correct
half-precision kernel rounds (probabilities and output rounded to the dtype, sums in float32), and
a backend may differ from the float32 reference by at most ROUNDING_FACTOR times that rounding
error, per kind of row and head.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from runtime.attention_backends.base import AttentionMetadata
from runtime.testing.paged_batch import token_major

# decodes first, then prefill chunks with and without earlier context
QUERY_LENS, SEQ_LENS = [1, 1, 1, 7, 20], [9, 40, 17, 7, 45]
BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 16, 8, 2, 64
GROUP = NUM_HEADS // NUM_KV_HEADS
FLOAT32_TOLERANCE = 1e-4  # atol = rtol: float32 differs only by the order of accumulation
# A half-precision backend may be this many times as far from the float32 reference as a
# correctly rounding kernel is expected to be (kernels round at slightly different points:
# online softmax, exp2); scores or sums kept in half precision are 8x to 25x as far.
ROUNDING_FACTOR = 4
STEPS = ("step 1 (prefill of the context, writing the KV cache)",
         "step 2 (decodes and prefill chunks reading the KV cache of step 1)")
DECODE, CHUNK, FIRST = "decode rows", "prefill-chunk rows", "first-step prefill rows"


@dataclass(frozen=True)
class AttentionCase:
    """The layer settings a check runs with (None: the backend's default)."""

    scale: float | None = None
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: tuple[float, ...] | None = None  # one attention-sink logit per query head
    # (request, start, end): positions [start, end) of the request attend to each other both
    # ways (an image's tokens, `AttentionMetadata.mm_prefix_ranges`), in the step whose rows
    # reach `end`, as the scheduler steps them
    mm_prefix_ranges: tuple[tuple[int, int, int], ...] | None = None

    @property
    def softmax_scale(self) -> float:
        return HEAD_SIZE ** -0.5 if self.scale is None else self.scale

    def describe(self, dtype: torch.dtype) -> str:
        sinks = "" if self.sinks is None else f", sinks {list(self.sinks)}"
        ranges = ("" if self.mm_prefix_ranges is None else
                  f", bidirectional (request, start, end) {list(self.mm_prefix_ranges)}")
        return (f"{str(dtype).removeprefix('torch.')}, scale {self.softmax_scale:.4g}, "
                f"sliding_window {self.sliding_window}, logits_soft_cap "
                f"{self.logits_soft_cap}{sinks}{ranges}, {NUM_HEADS} query heads over "
                f"{NUM_KV_HEADS} KV heads")

    def sink_tensor(self, device: str | torch.device) -> torch.Tensor | None:
        return None if self.sinks is None else torch.tensor(self.sinks, device=device)


# Sink logits of the size of the scores (about 3 at scale 0.37): some heads' sinks take most of
# the weight, others little, and no two heads share one, so a sink read from the wrong head shows
SINKS = (-1.5, 0.0, 1.0, 2.0, 2.5, 3.0, 4.0, 5.0)
# images in a first-step prefill, in a decode's context, and in a chunk, one of them begun in
# the cached context (a prefix-cache hit that ends inside an image)
MM_RANGES = ((3, 2, 5), (1, 36, 40), (4, 22, 28), (4, 33, 41))


# what the conformance suite checks, each for every dtype the platform declares: never the
# default scale head_size ** -0.5, so a hard-coded one shows
CASES = {"scale": AttentionCase(scale=0.37),
         "sliding-window": AttentionCase(scale=0.2, sliding_window=12),
         "soft-cap": AttentionCase(scale=0.37, logits_soft_cap=1.5),
         "sinks": AttentionCase(scale=0.37, sinks=SINKS),
         "sinks-sliding-window": AttentionCase(scale=0.2, sliding_window=12,
                                               sinks=tuple(x / 2 for x in SINKS)),
         "mm-prefix": AttentionCase(scale=0.37, mm_prefix_ranges=MM_RANGES),
         "mm-prefix-sliding-window": AttentionCase(scale=0.2, sliding_window=6,
                                                   mm_prefix_ranges=MM_RANGES)}


@dataclass(frozen=True)
class Rows:
    """One request's new tokens in one step: positions first .. first + count - 1."""

    request: int
    first: int
    count: int

    @property
    def kind(self) -> str:
        return DECODE if self.count == 1 else CHUNK if self.first else FIRST


def step_ranges(case: AttentionCase, rows: list[Rows]) -> list[list[tuple[int, int]]] | None:
    """Per row, the case's bidirectional ranges its step applies (None: none)."""
    if case.mm_prefix_ranges is None:
        return None
    ranges = [[(lo, hi) for request, lo, hi in case.mm_prefix_ranges
               if request == r.request and r.first < hi <= r.first + r.count] for r in rows]
    return ranges if any(ranges) else None


def step_rows() -> tuple[list[Rows], list[Rows]]:
    """Each step's requests in the order the step lays their tokens out (one-token ones first)."""
    context = sorted((Rows(i, 0, s - q) for i, (q, s) in enumerate(zip(QUERY_LENS, SEQ_LENS))
                      if s > q), key=lambda r: r.count > 1)
    return context, [Rows(i, s - q, q) for i, (q, s) in enumerate(zip(QUERY_LENS, SEQ_LENS))]


@dataclass(frozen=True)
class Attention:
    """What a reference computes; the fields besides `case` describe the bugs diagnosed."""

    case: AttentionCase
    kv_heads: tuple[int, ...] = tuple(h // GROUP for h in range(NUM_HEADS))
    span: int = 0  # each row attends to positions <= its own + span (causal: 0)
    rounding: torch.dtype | None = None  # round probabilities and output as such a kernel does


def reference(qkv: list[torch.Tensor], rows: list[Rows], how: Attention) -> torch.Tensor:
    """[tokens, heads, head_size] float32 attention of the step's rows over their requests'
    context, straight from the inputs (positions past a request's end read zeros: unwritten
    slots)."""
    case, outs = how.case, []
    heads = list(how.kv_heads)
    ranges = step_ranges(case, rows) or [[] for _ in rows]
    for r, spans in zip(rows, ranges):
        seq = qkv[r.request][:r.first + r.count]
        q = seq[r.first:, :NUM_HEADS]
        k = torch.cat([seq[:, NUM_HEADS:NUM_HEADS + NUM_KV_HEADS],
                       torch.zeros(1, NUM_KV_HEADS, HEAD_SIZE)])[:, heads]
        v = torch.cat([seq[:, NUM_HEADS + NUM_KV_HEADS:],
                       torch.zeros(1, NUM_KV_HEADS, HEAD_SIZE)])[:, heads]
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.softmax_scale
        if case.logits_soft_cap is not None:
            scores = case.logits_soft_cap * torch.tanh(scores / case.logits_soft_cap)
        q_pos = torch.arange(r.first, r.first + r.count)[:, None]
        k_pos = torch.arange(k.size(0))[None, :]
        mask = k_pos <= q_pos + how.span
        for lo, hi in spans:
            mask |= (q_pos >= lo) & (q_pos < hi) & (k_pos >= lo) & (k_pos < hi)
        if case.sliding_window is not None:
            mask &= k_pos > q_pos - case.sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        if case.sinks is None:
            probs = scores.softmax(-1).nan_to_num(0.0)
        else:
            sink = torch.tensor(case.sinks).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        if how.rounding is not None:
            probs = probs.to(how.rounding).float()
        out = torch.einsum("hqk,khd->qhd", probs, v)
        outs.append(out if how.rounding is None else out.to(how.rounding).float())
    return torch.cat(outs)


def make_inputs(dtype: torch.dtype, seed: int = 0) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Each request's q | k | v rows [seq_len, heads + 2 kv_heads, head_size], rounded through
    `dtype` (held in float32), and its block table over a shuffled pool of blocks."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in SEQ_LENS) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in SEQ_LENS]
    qkv = [torch.randn(s, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_SIZE, generator=gen)
           .to(dtype).float() for s in SEQ_LENS]
    return qkv, tables


def slots_of(rows: list[Rows], tables: list[list[int]]) -> list[int]:
    return [tables[r.request][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for r in rows for p in range(r.first, r.first + r.count)]


def metadata(rows: list[Rows], tables: list[list[int]], device,
             case: AttentionCase = AttentionCase()) -> AttentionMetadata:
    starts = [0]
    for r in rows:
        starts.append(starts[-1] + r.count)
    lens = [r.first + r.count for r in rows]
    table = torch.zeros(len(rows), max(map(len, tables)), dtype=torch.int32)
    for row, r in enumerate(rows):
        table[row, :len(tables[r.request])] = torch.tensor(tables[r.request])
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots_of(rows, tables), dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=table.to(device), query_start_loc_cpu=starts, seq_lens_cpu=lens,
        max_query_len=max(r.count for r in rows), max_seq_len=max(lens),
        num_decode_tokens=sum(r.count for r in rows if r.count == 1),
        mm_prefix_ranges=step_ranges(case, rows))


def run_steps(backend: type, qkv: list[torch.Tensor], tables: list[list[int]],
              dtype: torch.dtype, device, case: AttentionCase
              ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Run both steps through one layer of `backend`; per step, the output [tokens, heads,
    head_size] and the cache after it as [2, slots, kv_heads, head_size] (None when the
    backend's layout cannot be read back), on the CPU in float32."""
    impl = backend(NUM_HEADS, HEAD_SIZE, case.softmax_scale, NUM_KV_HEADS, case.sliding_window,
                   case.logits_soft_cap, case.sink_tensor(device))
    num_blocks = sum(map(len, tables)) + 2
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE),
                        dtype=dtype, device=device)
    results = []
    for rows in step_rows():
        batch = torch.cat([qkv[r.request][r.first:r.first + r.count] for r in rows])
        q, k, v = batch.to(device=device, dtype=dtype).split(
            [NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
        out = impl.forward(q.contiguous(), k.contiguous(), v.contiguous(), cache,
                           metadata(rows, tables, device, case))
        try:
            seen = token_major(backend, cache).float().cpu().flatten(1, 2)
        except ValueError:
            seen = None
        results.append((out.float().cpu(), seen))
    return results


def check_attention(backend: type, dtype: torch.dtype, device: str | torch.device,
                    case: AttentionCase = AttentionCase(), label: str = "") -> None:
    """Raise AssertionError, saying which kind of row and head differs, by how much, and which
    known bug the output matches, when `backend` differs from the float32 reference beyond the
    dtype's tolerance."""
    qkv, tables = make_inputs(dtype)
    results = run_steps(backend, qkv, tables, dtype, device, case)
    for step, (rows, (got, _)) in enumerate(zip(step_rows(), results)):
        exact = Attention(case)
        want = reference(qkv, rows, exact)
        bound = None if dtype == torch.float32 else rounding_error(
            reference(qkv, rows, dataclasses.replace(exact, rounding=dtype)), want, rows, dtype)
        lines = compare(got, want, rows, bound, dtype)
        if any(line.startswith("  ✗") for line in lines):
            failing = [k for k, line in zip(kinds(rows), lines) if line.startswith("  ✗")]
            found = diagnose(got, qkv, tables, rows, failing, results[:step + 1], case, bound,
                             dtype)
            raise AssertionError(
                f"attention backend {label or backend.name} differs from the float32 reference "
                f"in {STEPS[step]}, {case.describe(dtype)}:\n" + "\n".join(lines) + "\n"
                + "\n".join(f"  diagnosis: {d}" for d in found or [
                    "none of the known bugs matches (cache write, seq_len off by one, KV-head "
                    "mapping, scale, soft-cap, sinks, window): compare the worst row above by "
                    "hand"]))


def rounding_error(rounded: torch.Tensor, exact: torch.Tensor, rows: list[Rows],
                   dtype: torch.dtype) -> torch.Tensor:
    """The error a correctly rounding `dtype` kernel makes at each value: half a unit in the
    last place of the value, plus the root mean square error of the reference rounded as such a
    kernel rounds (`rounded`), per kind of row and query head."""
    error = exact.abs().clamp_min(2 ** -14) * torch.finfo(dtype).eps / 2
    for kind in kinds(rows):
        index = token_index(rows, kind)
        error[index] += (rounded - exact)[index].pow(2).mean(dim=(0, 2), keepdim=True).sqrt()
    return error


def kinds(rows: list[Rows]) -> list[str]:
    return list(dict.fromkeys(r.kind for r in rows))


def token_index(rows: list[Rows], kind: str) -> torch.Tensor:
    starts, index = 0, []
    for r in rows:
        if r.kind == kind:
            index += range(starts, starts + r.count)
        starts += r.count
    return torch.tensor(index, dtype=torch.long)


def within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | None,
           dtype: torch.dtype) -> torch.Tensor:
    """Per value, whether `got` is close enough to `want`: float32 atol = rtol = 1e-4; a half
    dtype within ROUNDING_FACTOR times the `rounding_error` (`bound`)."""
    if bound is None:
        return torch.isclose(got, want, atol=FLOAT32_TOLERANCE, rtol=FLOAT32_TOLERANCE)
    return (got - want).abs() <= ROUNDING_FACTOR * bound


def compare(got: torch.Tensor, want: torch.Tensor, rows: list[Rows],
            bound: torch.Tensor | None, dtype: torch.dtype) -> list[str]:
    """One line per kind of row: "✓" when it matches, else "✗" with the heads that differ and
    the worst value."""
    if got.shape != want.shape:
        return [f"  ✗ output shape {tuple(got.shape)}, expected {tuple(want.shape)}"]
    lines = []
    for kind in kinds(rows):
        index = token_index(rows, kind)
        g, w = got[index], want[index]
        b = None if bound is None else bound[index]
        ok = within(g, w, b, dtype)
        who = describe_rows(rows, kind)
        if ok.all():
            lines.append(f"  ✓ {kind} ({who}) match")
            continue
        heads = [h for h in range(NUM_HEADS) if not ok[:, h].all()]
        error = (g - w).abs().nan_to_num(float("inf"))
        error = (error if b is None else error / b).masked_fill(ok, 0)
        token, head, dim = divmod_all(int(error.argmax()), g.shape[1:])
        request, position = locate(rows, kind, token)
        allowed = (f"atol = rtol = {FLOAT32_TOLERANCE:g}" if b is None else
                   f"{error.max().item():.0f}x the "
                   f"{str(dtype).removeprefix('torch.')} rounding error "
                   f"{b[token, head, dim].item():.2g} there; {ROUNDING_FACTOR}x allowed")
        lines.append(
            f"  ✗ {kind} ({who}): {int((~ok).sum())} of {ok.numel()} values differ, in query "
            f"heads {heads_text(heads)}; the worst at request {request} position {position}, "
            f"head {head} (KV head {head // GROUP}), dim {dim}: got {g[token, head, dim]:.6g}, "
            f"want {w[token, head, dim]:.6g} ({allowed})")
    return lines


def divmod_all(flat: int, shape: torch.Size) -> tuple[int, int, int]:
    token, rest = divmod(flat, shape[0] * shape[1])
    return (token, *divmod(rest, shape[1]))


def locate(rows: list[Rows], kind: str, token: int) -> tuple[int, int]:
    for r in rows:
        if r.kind == kind:
            if token < r.count:
                return r.request, r.first + token
            token -= r.count
    raise IndexError(token)


def describe_rows(rows: list[Rows], kind: str) -> str:
    return ", ".join(f"request {r.request} position {r.first}" if r.count == 1 else
                     f"request {r.request} positions {r.first}-{r.first + r.count - 1}"
                     for r in rows if r.kind == kind)


def heads_text(heads: list[int]) -> str:
    if heads == list(range(heads[0], heads[-1] + 1)) and len(heads) > 2:
        return f"{heads[0]}-{heads[-1]}"
    return ", ".join(map(str, heads))


def diagnose(got: torch.Tensor, qkv: list[torch.Tensor], tables: list[list[int]],
             rows: list[Rows], failing: list[str], results: list, case: AttentionCase,
             bound: torch.Tensor | None, dtype: torch.dtype) -> list[str]:
    """The known bugs the failing rows' output matches, as sentences a vendor can act on."""
    found = unwritten_cache(qkv, tables, results)
    if found:
        return found  # every other comparison reads the cache, so this explains them
    for kind in failing:
        index = token_index(rows, kind)

        def matches(how: Attention) -> bool:
            b = None if bound is None else bound[index]
            return bool(within(got[index], reference(qkv, rows, how)[index], b, dtype).all())

        found += [f"{kind} {text}" for how, text in variants(case) if matches(how)]
        mapping = kv_head_mapping(got[index], qkv, rows, index, case, bound, dtype)
        if mapping:
            found.append(f"{kind}: {mapping}")
    if not found and bound is not None:
        exact = reference(qkv, rows, Attention(case))
        worst = ((got - exact).abs() / bound).max().item()
        if len(failing) == len(kinds(rows)) and worst < 1e3:
            found.append(
                f"every kind of row is off by up to {worst:.0f}x the rounding error of a "
                f"correct {str(dtype).removeprefix('torch.')} kernel, with no other pattern: "
                f"the arithmetic loses precision (scores, the softmax sum or P·V accumulated in "
                f"{str(dtype).removeprefix('torch.')}, or exp without subtracting the row max)")
    return found


def variants(case: AttentionCase) -> list[tuple[Attention, str]]:
    """The bugs diagnosed by attention computed differently, with what to say when one
    matches (after the kind of row)."""
    plain = Attention(case)
    found = [(dataclasses.replace(plain, span=-1),
              "attend to seq_len − 1 positions: each row leaves out its own position"),
             (dataclasses.replace(plain, span=1),
              "attend to seq_len + 1 positions: each row also reads the slot after its own "
              "(the causal mask is off by one)")]
    if case.scale is not None:
        found.append((Attention(dataclasses.replace(case, scale=None)),
                      f"use the default scale head_size ** -0.5 = {HEAD_SIZE ** -0.5:.4g}, not "
                      f"the layer's scale {case.scale:g}"))
    if case.logits_soft_cap is not None:
        found.append((Attention(dataclasses.replace(case, logits_soft_cap=None)),
                      f"apply no logit soft-cap: scores must become cap · tanh(scores / cap) "
                      f"with cap {case.logits_soft_cap:g}"))
    if case.sinks is not None:
        found.append((Attention(dataclasses.replace(case, sinks=None)),
                      "have no attention sinks applied: each head's sink logit must join its "
                      "softmax's denominator (weights summing to less than one), adding no "
                      "value"))
    if case.mm_prefix_ranges is not None:
        found.append((Attention(dataclasses.replace(case, mm_prefix_ranges=None)),
                      "ignore `mm_prefix_ranges`: a query inside an image's range must also "
                      "see the range's later keys"))
    if case.sliding_window is not None:
        w = case.sliding_window
        found += [(Attention(dataclasses.replace(case, sliding_window=None)),
                   f"ignore the sliding window of {w}: they attend to the whole context"),
                  (Attention(dataclasses.replace(case, sliding_window=w + 1)),
                   f"keep {w + 1} positions in the sliding window, one too many: a window of "
                   f"{w} holds the row's own position and the {w - 1} before it "
                   f"(q_pos - {w} < k_pos <= q_pos)"),
                  (Attention(dataclasses.replace(case, sliding_window=w - 1)),
                   f"keep {w - 1} positions in the sliding window, one too few: a window of "
                   f"{w} holds the row's own position and the {w - 1} before it "
                   f"(q_pos - {w} < k_pos <= q_pos)")]
    return found


def kv_head_mapping(got: torch.Tensor, qkv: list[torch.Tensor], rows: list[Rows],
                    index: torch.Tensor, case: AttentionCase, bound: torch.Tensor | None,
                    dtype: torch.dtype) -> str | None:
    """When every query head matches attention over exactly one KV head, but not the right one
    for some head: which mapping the backend uses."""
    per_kv = [reference(qkv, rows, Attention(case, kv_heads=(j,) * NUM_HEADS))[index]
              for j in range(NUM_KV_HEADS)]
    mapping = []
    for h in range(NUM_HEADS):
        hits = [j for j in range(NUM_KV_HEADS) if within(
            got[:, h], per_kv[j][:, h], None if bound is None else bound[index][:, h],
            dtype).all()]
        if len(hits) != 1:
            return None
        mapping += hits
    right = [h // GROUP for h in range(NUM_HEADS)]
    if mapping == right:
        return None
    modulo = mapping == [h % NUM_KV_HEADS for h in range(NUM_HEADS)]
    return (f"query heads 0-{NUM_HEADS - 1} read KV heads {mapping}"
            f"{' (h % num_kv_heads, a modulo mapping)' if modulo else ''}; grouped-query "
            f"attention maps query head h to KV head h // (num_heads // num_kv_heads) = "
            f"{right}")


def unwritten_cache(qkv: list[torch.Tensor], tables: list[list[int]],
                    results: list) -> list[str]:
    """For each step so far and kind of row: whether the cache holds, at the rows' slots, the K
    and V the step passed in."""
    found = []
    for step, (rows, (_, cache)) in enumerate(zip(step_rows(), results)):
        if cache is None:
            continue
        for kind in kinds(rows):
            mine = [r for r in rows if r.kind == kind]
            written = torch.cat([qkv[r.request][r.first:r.first + r.count] for r in mine])
            held = cache[:, slots_of(mine, tables)]
            wrong = [name for name, part, want in (
                ("K", held[0], written[:, NUM_HEADS:NUM_HEADS + NUM_KV_HEADS]),
                ("V", held[1], written[:, NUM_HEADS + NUM_KV_HEADS:]))
                if not torch.equal(part, want)]
            if wrong:
                found.append(f"the KV cache was not written for {kind} in step {step + 1}: "
                             f"{' and '.join(wrong)} at their slots (metadata.slot_mapping) "
                             f"are not the {' and '.join(wrong)} the step passed in")
    return found
