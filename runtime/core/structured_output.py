"""The engine core's side of structured outputs: grammars compiled off the step loop, one
matcher per constrained sequence, and the step's token bitmask.

A constrained request waits here (not in the scheduler) until its grammar is compiled, so it
never holds the batch. Each sequence (each sample of an n > 1 request) gets its own matcher,
advanced with the tokens the sequence accepts; matchers live in the core with the tokens, so a
preempted request resumes with its matcher as it was, and one re-admitted with its generated
tokens (its engine core died) gets a fresh matcher advanced over them. Speculative proposals
are cut to the prefix the matcher accepts before they are scheduled, so each proposal row's
mask is the matcher's state after the proposals before it. A sampled token the matcher refuses (the
request's other controls left no token its grammar allows) is never accepted: the request ends
there with an error.

A request whose params carry reasoning markers (`_reasoning_token_ids`, from the server's
--reasoning-parser) is unconstrained while it reasons, as in vLLM: its matcher starts with the
tokens after the end marker. The reasoning is over from the start when the prompt's last marker
is an end marker (a template that closed the thinking: Qwen3's enable_thinking false).
Proposals are cut before an end marker, so the end marker is always a step's last token and
every token after it is sampled under the grammar.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runtime.structured_output.stats import add_compile_time, empty_counts

if TYPE_CHECKING:
    from runtime.request import Request

# Compiled grammars kept for later requests with the same constraint, least recently used
# dropped past this (xgrammar's compiled JSON schema for a 49152-token vocabulary is ~1.25 MB).
MAX_CACHE_BYTES = 256 * 2**20


class StructuredOutputManager:
    """`make_compiler` builds the vocabulary's compiler (`backends.make_compiler`: xgrammar's
    or llguidance's); it is called once: by `build_compiler` (the core calls it at start-up
    when the configuration names a backend), else by the first constrained request's compile,
    in a pool thread. Compiled grammars are cached by their constraint up to `max_cache_bytes` (LRU; a running
    request's matcher keeps its grammar alive without the cache)."""

    def __init__(self, make_compiler: Callable[[], Any], max_workers: int = 2,
                 max_cache_bytes: int = MAX_CACHE_BYTES) -> None:
        self._make_compiler = make_compiler
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._max_workers = max_workers
        # compiled grammars (pending or done), by kind and text, least recently used first
        self._grammars: OrderedDict[tuple, Future] = OrderedDict()
        self._sizes: dict[tuple, int] = {}  # of the compiled ones the cache counts
        self.max_cache_bytes = max_cache_bytes
        self.cache_bytes = 0
        self.waiting: dict[str, tuple[Request, Future]] = {}  # in arrival order
        self.matchers: dict[str, Any] = {}  # the backend's matchers, as xgrammar's are called
        self.reasoning: dict[str, int] = {}  # requests still reasoning -> their end marker id
        # cumulative, for /metrics
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.num_cache_misses = 0
        self.compile_seconds = 0.0
        self.compile_counts = empty_counts()  # compiles per COMPILE_SECONDS_BUCKETS bucket

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (or reuse it); the request waits here."""
        key = request.params.structured_outputs.key
        future = self._grammars.get(key)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="grammar")
            future = self._pool.submit(self._compile, request.params.structured_outputs)
            self._grammars[key] = future
            self.num_cache_misses += 1
        else:
            self._grammars.move_to_end(key)
            self.num_cache_hits += 1
        self.waiting[request.request_id] = (request, future)

    def build_compiler(self) -> None:
        """Build the vocabulary's compiler now, if not yet (it is otherwise built by the first
        constrained request's compile, in a pool thread that contends with the step loop)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()

    def _compile(self, params) -> Any:
        self.build_compiler()
        start = time.perf_counter()
        compiled = self._compiler.compile(params)
        seconds = time.perf_counter() - start
        with self._compiler_lock:
            self.compile_seconds += seconds
            self.num_compiles += 1
            add_compile_time(self.compile_counts, seconds)
        return compiled

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """The waiting requests whose grammar is compiled, each with its matcher made, in
        arrival order; and those whose grammar failed to compile, with the error."""
        ready, failed = [], []
        for request_id, (request, future) in list(self.waiting.items()):
            if not future.done():
                continue
            del self.waiting[request_id]
            key = request.params.structured_outputs.key
            if future.exception() is not None:
                if self._grammars.get(key) is future:
                    del self._grammars[key]
                failed.append((request, future.exception()))
                continue
            matcher = self._compiler.matcher(future.result())
            self._count(key, future)
            replayed = request.output_token_ids  # a re-admitted request's, under the grammar
            markers = request.params._reasoning_token_ids
            if markers is not None:
                if not reasoning_ended(request.all_token_ids, *markers):
                    self.reasoning[request_id] = markers[1]
                    replayed = []  # still reasoning: the grammar starts after its end marker
                elif markers[1] in replayed:  # it ended in the output: the grammar read the rest
                    replayed = replayed[len(replayed) - replayed[::-1].index(markers[1]):]
            refused = self._replay(matcher, replayed)
            if refused is not None:
                failed.append((request, ValueError(refused)))
                continue
            self.matchers[request_id] = matcher
            ready.append(request)
        return ready, failed

    def _replay(self, matcher: Any, token_ids: list[int]) -> str | None:
        """Advance a fresh matcher over the tokens a re-admitted request had generated
        (under this grammar, on a core that died); returns why it refused one, if it did."""
        stop = self._compiler.stop_token_ids
        for i, token_id in enumerate(token_ids):
            if matcher.is_terminated() and token_id in stop:
                continue
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                return (f"generated token {i} ({token_id}) does not follow the request's "
                        "structured_outputs grammar on re-admission")
        return None

    def _count(self, key: tuple, future: Future) -> None:
        """Count a compiled grammar in the cache once, then drop the least recently used
        compiled ones (never one still compiling) until the cache fits."""
        if key in self._sizes or self._grammars.get(key) is not future:
            return
        self._sizes[key] = self._compiler.size_of(future.result())
        self.cache_bytes += self._sizes[key]
        for old in list(self._grammars):
            if self.cache_bytes <= self.max_cache_bytes:
                break
            if old in self._sizes and old != key:
                del self._grammars[old]
                self.cache_bytes -= self._sizes.pop(old)

    def wait(self, timeout: float) -> None:
        """Block until a waiting grammar is compiled, or `timeout` seconds."""
        futures = {f for _, f in self.waiting.values()}
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def drop(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)
        self.matchers.pop(request_id, None)
        self.reasoning.pop(request_id, None)

    def bitmask(self, scheduled: list[tuple[Request, int]]) -> tuple[np.ndarray | None,
                                                                      dict[str, int]]:
        """The allowed tokens of every constrained row this step samples: int32 [rows,
        ceil(vocab / 32)], bit t of a row set when token t is allowed, and each request's first
        row. A request verifying k proposals has k + 1 rows: row j follows proposal j - 1. A
        complete grammar (its stop token taken, the request going on: ignore_eos) allows only
        stop tokens."""
        rows: dict[str, int] = {}
        if not self.matchers:
            return None, rows
        num_rows = 0
        for r, n in scheduled:
            samples = r.num_computed_tokens + n - len(r.spec_token_ids) >= r.num_tokens
            if r.request_id in self.matchers and r.request_id not in self.reasoning \
                    and samples:
                rows[r.request_id] = num_rows
                num_rows += 1 + len(r.spec_token_ids)
        if not rows:
            return None, rows
        bitmask = torch.full((num_rows, -(-self._compiler.vocab_size // 32)), -1,
                             dtype=torch.int32)
        for r, _ in scheduled:
            if r.request_id not in rows:
                continue
            matcher, row = self.matchers[r.request_id], rows[r.request_id]
            if matcher.is_terminated():
                bitmask[row] = torch.from_numpy(self._compiler.stop_bitmask)
                continue
            for j, token_id in enumerate(r.spec_token_ids):
                matcher.fill_next_token_bitmask(bitmask, row + j)
                matcher.accept_token(token_id)
            matcher.fill_next_token_bitmask(bitmask, row + len(r.spec_token_ids))
            if r.spec_token_ids:
                matcher.rollback(len(r.spec_token_ids))
        return bitmask.numpy(), rows

    def accept(self, scheduled: list[tuple[Request, int]],
               sampled: dict[str, list[int]]) -> dict[str, str]:
        """Feed each constrained request's matcher the tokens it sampled this step. A token the
        grammar refuses, and all after it, are cut from `sampled`; returns those requests, each
        with why it must end."""
        refused: dict[str, str] = {}
        if not self.matchers:
            return refused
        stop = self._compiler.stop_token_ids
        for r, _ in scheduled:
            matcher = self.matchers.get(r.request_id)
            tokens = sampled.get(r.request_id)
            if matcher is None or not tokens:
                continue
            first = 0  # the first token the grammar reads
            end = self.reasoning.get(r.request_id)
            if end is not None:
                if end not in tokens:
                    continue
                del self.reasoning[r.request_id]
                first = tokens.index(end) + 1
            for i, token_id in enumerate(tokens[first:], first):
                if matcher.is_terminated() and token_id in stop:
                    continue  # the grammar is complete: only stop tokens can follow
                if matcher.is_terminated() or not matcher.accept_token(token_id):
                    refused[r.request_id] = (
                        f"token {token_id} breaks the request's structured_outputs grammar: "
                        "no token the grammar allows was left by the other sampling controls "
                        "(allowed_token_ids, bad_words, logit_bias, min_tokens)")
                    sampled[r.request_id] = tokens[:i]
                    break
        return refused

    def advance(self, scheduled: list[tuple[Request, int]]) -> None:
        """After the step's tokens are in: drop each constrained request's matcher if it
        finished, else cut its next proposals to the prefix the grammar allows."""
        if not self.matchers:
            return
        for request, _ in scheduled:
            matcher = self.matchers.get(request.request_id)
            if matcher is None:
                continue
            if request.is_finished:
                self.drop(request.request_id)
                continue
            end = self.reasoning.get(request.request_id)
            if end is not None:
                if end in request.spec_token_ids:
                    del request.spec_token_ids[request.spec_token_ids.index(end):]
                continue
            num_valid = 0
            for token_id in request.spec_token_ids:
                if matcher.is_terminated() or not matcher.accept_token(token_id):
                    break
                num_valid += 1
            if num_valid:
                matcher.rollback(num_valid)
            del request.spec_token_ids[num_valid:]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def reasoning_ended(token_ids: list[int], start_id: int, end_id: int) -> bool:
    """Whether the last reasoning marker among `token_ids` is the end marker (vLLM's rule:
    an earlier turn's closed thinking followed by a new start marker is open again)."""
    for token_id in reversed(token_ids):
        if token_id == start_id:
            return False
        if token_id == end_id:
            return True
    return False
