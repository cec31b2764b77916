"""The executors: Ray actors with TP=2, a worker killed mid-run, and the errors for bad choices."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from runtime import LLM, SamplingParams
from runtime.executor.base import WorkerError

ENGINE = dict(dtype="float32", kv_cache_memory="8MiB", num_threads=1)
PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1] + list(range(300, 337)), [1, 77, 88]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def single_rank(tiny_llama) -> list[list[int]]:
    return tokens(LLM(tiny_llama, **ENGINE).generate(PROMPTS, GREEDY))


def test_ray_tensor_parallel(tiny_llama, single_rank):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray",
                  **ENGINE)
        assert tokens(llm.generate(PROMPTS, GREEDY)) == single_rank
        llm.engine.core.shutdown()
    finally:
        ray.shutdown()


def test_killed_worker_fails_the_engine_quickly(tiny_llama, single_rank):
    llm = LLM(tiny_llama, tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    for prompt in PROMPTS:
        engine.add_request({"prompt_token_ids": prompt}, GREEDY)
    engine.step()
    engine.step()  # requests are mid-generation
    worker = engine.core.executor.processes[1]
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) died with exit code -9"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    survivor = engine.core.executor.processes[0]
    survivor.join(10)
    assert not survivor.is_alive(), "the surviving worker was left running"
    with pytest.raises(WorkerError, match="worker rank 1"):  # and it stays failed
        engine.step()


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=3), r"tensor_parallel_size 3 must divide the model's 4 "
                                   r"attention heads; allowed: \[1, 2, 4\]"),
    (dict(pipeline_parallel_size=3), r"pipeline_parallel_size 3 exceeds the model's 2 layers"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uniproc"),
     r"the uniproc executor runs one rank.*choose 'mp' or 'ray'"),
    (dict(distributed_executor_backend="slurm"),
     r"distributed_executor_backend must be one of \('uniproc', 'mp', 'ray'\), got 'slurm'"),
    (dict(tensor_parallel_size=0), r"tensor_parallel_size must be >= 1, got 0"),
    (dict(data_parallel_size=2), r"data_parallel_size 2 runs engine replicas behind the "
                                 r"server \(runtime serve --data-parallel-size N\)"),
])
def test_bad_choices_are_named(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, **{**ENGINE, **kwargs})


def test_ray_missing_is_named(tiny_llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ValueError, match=r"'ray' needs Ray: pip install ray"):
        LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
