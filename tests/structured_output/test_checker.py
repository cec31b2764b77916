"""The API process's grammar checker: the backend's verdict from a worker process, a crash or a
runaway check costing only that worker, limits named in the error, results cached in bytes."""
from __future__ import annotations

import asyncio

import pytest

from runtime.structured_output.checker import CheckCache, GrammarChecker, GrammarLimitError
from runtime.structured_output.params import StructuredOutputsParams


def chained_lark(num_rules: int) -> str:
    """A Lark grammar of `num_rules` rules, each calling the next: llguidance 1.x overflows its
    stack validating it (a segfault in whatever process does it)."""
    rules = "\n".join(f'r{i}: "x" r{i + 1}' for i in range(num_rules))
    return f'start: r0\n{rules}\nr{num_rules}: "y"'


def run(checker: GrammarChecker, *constraints: StructuredOutputsParams) -> list:
    """Each constraint's check on one event loop, in order: None or the exception raised."""
    async def main() -> list:
        try:
            results = []
            for params in constraints:
                try:
                    await checker.check(params)
                    results.append(None)
                except Exception as e:
                    results.append(e)
            return results
        finally:
            checker.shutdown()
    return asyncio.run(main())


def test_the_backend_verdict_comes_from_a_worker_and_is_cached():
    checker = GrammarChecker("xgrammar", workers=1)
    good = StructuredOutputsParams(regex="[a-z]+")
    bad = StructuredOutputsParams(regex="(unclosed")
    results = run(checker, good, bad, StructuredOutputsParams(regex="[a-z]+"))
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], ValueError) and "not a valid regex" in str(results[1])
    assert good._checked_by == "xgrammar"  # the engine will not check it again
    assert checker.cache.get(good.key) == (True, None)
    assert checker.cache.get(bad.key)[1] == str(results[1])


def test_a_grammar_that_crashes_the_library_costs_one_worker():
    pytest.importorskip("llguidance")
    checker = GrammarChecker("guidance", workers=1)
    results = run(checker, StructuredOutputsParams(grammar=chained_lark(3000)),
                  StructuredOutputsParams(grammar='start: "yes" | "no"'))
    assert isinstance(results[0], ValueError) and "crashed on it" in str(results[0]), results
    assert results[1] is None  # a new worker took the next request


def test_limits_are_named_and_a_killed_worker_is_replaced():
    checker = GrammarChecker("xgrammar", workers=1, max_bytes=1000)
    long = StructuredOutputsParams(choice=["x" * 600, "y" * 600])
    results = run(checker, long)
    assert isinstance(results[0], GrammarLimitError) and "--max-grammar-bytes" in str(results[0])

    async def main() -> list:
        try:
            await checker.check(StructuredOutputsParams(regex="warm"))  # the worker is up
            checker.timeout_s = 1e-6
            with pytest.raises(GrammarLimitError, match="--grammar-check-timeout"):
                await checker.check(StructuredOutputsParams(regex="[0-9]{3}"))
            checker.timeout_s = 60
            await checker.check(StructuredOutputsParams(regex="[0-9]{3}"))
        finally:
            checker.shutdown()
    asyncio.run(main())


def test_the_cache_drops_the_least_recently_used_past_its_bytes():
    cache = CheckCache(max_bytes=1000)
    keys = [("regex", f"{i}" * 300, False) for i in range(3)]
    cache.put(keys[0], None)
    cache.put(keys[1], "refused")
    assert cache.get(keys[0]) == (True, None)  # now the most recently used
    cache.put(keys[2], None)
    assert cache.get(keys[1]) == (False, None) and cache.get(keys[0]) == (True, None)
    assert cache.bytes <= 1000


def test_the_cores_grammar_cache_is_bounded_in_bytes(tokenizer_dir):
    """Distinct schemas no longer grow the engine core without bound: past the cache's bytes
    the least recently used compiled grammar goes, and a running request keeps its matcher."""
    from transformers import AutoTokenizer

    from runtime.request import Request
    from runtime.sampling_params import SamplingParams
    from runtime.structured_output.backends import make_compiler
    from runtime.core.structured_output import StructuredOutputManager

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    manager = StructuredOutputManager(
        lambda: make_compiler("xgrammar", tokenizer, len(tokenizer), [tokenizer.eos_token_id]),
        max_cache_bytes=1)  # room for none but the newest
    requests = [Request(f"r{i}", [1], SamplingParams(structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}})), 8)
        for i in range(3)]
    for request in requests:
        manager.add_request(request)
        manager.wait(60)
        ready, failed = manager.take_ready()
        assert [r.request_id for r in ready] == [request.request_id] and not failed
    assert len(manager._grammars) == 1 and manager.cache_bytes > 0
    assert set(manager.matchers) == {"r0", "r1", "r2"}
    manager.add_request(requests[0])  # evicted: compiled again
    assert manager.num_cache_misses == 4 and manager.num_cache_hits == 0
    manager.shutdown()
