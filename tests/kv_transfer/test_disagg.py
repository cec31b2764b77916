"""Disaggregated prefill through the SharedStorageConnector: a producer engine prefills, a
consumer engine loads the prompt's KV from the shared folder and decodes, with the tokens and
logprobs of one engine doing both; the consumer computes only the prompt's last block, and a
request that comes before its KV waits for it. A KV that never arrives, or a corrupt file, is
computed instead; bad kv_transfer_params are refused."""
from __future__ import annotations

import os
import random

import pytest

from runtime import LLM, SamplingParams

BLOCK = 4
random.seed(1)
PROMPTS = [[random.randrange(3, 30000) for _ in range(30)] for _ in range(5)]
LOADED = (30 - 1) // BLOCK * BLOCK  # full blocks before the last token: 28 tokens


def engine(model: str, role: str, folder: str, **extra) -> LLM:
    return LLM(model, dtype="float32", block_size=BLOCK, max_model_len=128,
               kv_cache_memory=64 * 2048, kv_transfer_config={
                   "kv_connector": "SharedStorageConnector", "kv_role": role,
                   "kv_connector_extra_config": {"shared_storage_path": folder, **extra}})


def sampling(max_tokens: int, params: dict | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                          extra_args=None if params is None else {"kv_transfer_params": params})


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("shared_kv"))
    producer = engine(tiny_llama, "kv_producer", folder)
    consumer = engine(tiny_llama, "kv_consumer", folder, load_timeout=2)
    return producer, consumer, folder


def prefill(producer: LLM, prompt: list[int]) -> dict:
    out = producer.generate([prompt], sampling(1, {"do_remote_decode": True}), use_tqdm=False)[0]
    return out.kv_transfer_params


def test_consumer_decodes_the_producers_prefill_exactly(pair):
    producer, consumer, _ = pair
    prompt = PROMPTS[0]
    (alone,) = producer.generate([prompt], sampling(8), use_tqdm=False)
    params = prefill(producer, prompt)
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == LOADED
    (out,) = consumer.generate([prompt], sampling(8, params), use_tqdm=False)
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    for a, b in zip(alone.outputs[0].logprobs, out.outputs[0].logprobs):
        (token,) = a
        assert abs(a[token].logprob - b[token].logprob) < 2e-3
    assert out.num_cached_tokens == LOADED  # only the last block's tokens were computed
    core = consumer.engine.core
    assert core.kv.num_cache_hits == 0  # none from its own prefix cache
    stats = core.kv_connector.stats()
    assert stats["loaded_blocks"] == LOADED // BLOCK and stats["failed_loads"] == 0
    assert producer.engine.core.kv_connector.stats()["saved_blocks"] == LOADED // BLOCK


def test_a_request_waits_in_the_scheduler_for_kv_on_its_way(pair):
    producer, consumer, _ = pair
    prompt = PROMPTS[3]
    (alone,) = producer.generate([prompt], sampling(4), use_tqdm=False)
    params = {"do_remote_prefill": True, "remote_num_tokens": LOADED}
    request_id = consumer.engine.add_request(prompt, sampling(4, params))
    for _ in range(3):  # the decode request came first: nothing runs
        assert consumer.engine.step() == []
    assert consumer.engine.core.scheduler.num_waiting() == 1
    prefill(producer, prompt)
    outputs = []
    while consumer.engine.has_unfinished_requests():
        outputs += consumer.engine.step()
    (out,) = [o for o in outputs if o.request_id == request_id and o.finished]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert out.num_cached_tokens == LOADED


def test_kv_that_never_arrives_or_is_corrupt_is_computed(pair):
    producer, consumer, folder = pair
    (alone,) = producer.generate([PROMPTS[1]], sampling(6), use_tqdm=False)
    params = {"do_remote_prefill": True, "remote_num_tokens": LOADED}  # never prefilled
    (out,) = consumer.generate([PROMPTS[1]], sampling(6, params), use_tqdm=False)
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert out.num_cached_tokens == 0
    assert consumer.engine.core.kv_connector.stats()["timed_out_requests"] == 1

    (alone,) = producer.generate([PROMPTS[2]], sampling(6), use_tqdm=False)
    (namespace,) = [os.path.join(folder, d) for d in os.listdir(folder)]
    before = set(os.listdir(namespace))
    params = prefill(producer, PROMPTS[2])
    new = sorted(set(os.listdir(namespace)) - before)
    assert len(new) == LOADED // BLOCK
    with open(os.path.join(namespace, new[3]), "r+b") as f:  # corrupt one of them
        f.seek(-8, os.SEEK_END)
        f.write(b"garbage!")
    (out,) = consumer.generate([PROMPTS[2]], sampling(6, params), use_tqdm=False)
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert 0 < out.num_cached_tokens < LOADED  # the blocks before the corrupt one were loaded
    assert consumer.engine.core.kv_connector.stats()["failed_loads"] == 1


@pytest.mark.parametrize("params, error", [
    ({"do_remote_decode": True}, "needs a prefill instance"),
    ({"do_remote_prefill": "yes"}, "must be true or false"),
    ({"bogus": "x"}, "unknown keys ['bogus']"),
])
def test_bad_kv_transfer_params_are_refused(pair, params, error):
    _, consumer, _ = pair
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        consumer.generate([PROMPTS[4]], sampling(2, params), use_tqdm=False)


def test_kv_transfer_params_need_a_connector(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=64, kv_cache_memory=32 * 2048)
    with pytest.raises(ValueError, match="needs a KV connector"):
        llm.generate([PROMPTS[4]], sampling(2, {"do_remote_decode": True}), use_tqdm=False)


def test_over_tcp_the_consumer_decodes_the_producers_prefill(tiny_llama):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def tcp(role: str) -> LLM:
        return LLM(tiny_llama, dtype="float32", block_size=BLOCK, max_model_len=128,
                   kv_cache_memory=64 * 2048, kv_transfer_config={
                       "kv_connector": "P2pTcpConnector", "kv_role": role,
                       "kv_connector_extra_config": {"kv_port": port}})
    producer, consumer = tcp("kv_producer"), tcp("kv_consumer")
    prompt = PROMPTS[0]
    (alone,) = producer.generate([prompt], sampling(8), use_tqdm=False)
    params = prefill(producer, prompt)
    assert params["remote_port"] == port and params["remote_num_tokens"] == LOADED
    (out,) = consumer.generate([prompt], sampling(8, params), use_tqdm=False)
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    for a, b in zip(alone.outputs[0].logprobs, out.outputs[0].logprobs):
        (token,) = a
        assert abs(a[token].logprob - b[token].logprob) < 2e-3
    assert out.num_cached_tokens == LOADED
    # fetched once: asked again (or for another prompt's params), the prompt is computed
    (again,) = consumer.generate([PROMPTS[1]], sampling(8, params), use_tqdm=False)
    (expected,) = producer.generate([PROMPTS[1]], sampling(8), use_tqdm=False)
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids
    assert again.num_cached_tokens == 0
    assert consumer.engine.core.kv_connector.stats()["failed_loads"] == 1
    producer.engine.core.shutdown()


def test_a_tcp_fetch_runs_beside_the_step_and_lands_by_its_end():
    """The consumer's start_load_kv returns while the producer has not answered yet; the
    blocks are in when get_finished returns."""
    import socket
    import threading

    import torch

    from runtime.kv_transfer.p2p.worker import P2pTcpWorker
    from runtime.plugins.kv_connector import KVCacheLayer, KVConnectorContext
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def side(role: str, cache: torch.Tensor) -> P2pTcpWorker:
        worker = P2pTcpWorker(KVConnectorContext(role, BLOCK, "ns", {"kv_port": port}))
        worker.register_kv_caches([KVCacheLayer("layer.0", cache, 0)])
        return worker
    produced, consumed = torch.arange(4 * 8.0).view(4, 8), torch.zeros(4, 8)
    producer, consumer = side("kv_producer", produced), side("kv_consumer", consumed)
    hashes = [b"a", b"b"]
    producer.start_load_kv([("stage", "p", [0, 1], hashes)])
    answer, release = producer._answer, threading.Event()
    producer._answer = lambda ask: release.wait(10) and answer(ask)
    try:
        consumer.start_load_kv([("fetch", "127.0.0.1", port, "p", 0, hashes, [2, 3], "c")])
        assert consumed.eq(0).all()  # the producer is still holding its answer back
        release.set()
        report = consumer.get_finished()
    finally:
        producer.shutdown()
        consumer.shutdown()
    assert not report.failed_loads and report.bytes_loaded == 2 * 8 * 4
    assert torch.equal(consumed[2:], produced[:2])


def test_the_fail_policy_ends_a_request_whose_load_failed(pair, tiny_llama):
    """kv_load_failure_policy "fail" (vLLM's): the corrupt block's request ends with an error
    instead of computing it; the engine goes on."""
    producer, _, folder = pair
    consumer = LLM(tiny_llama, dtype="float32", block_size=BLOCK, max_model_len=128,
                   kv_cache_memory=64 * 2048, kv_transfer_config={
                       "kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer",
                       "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": {"shared_storage_path": folder}})
    params = prefill(producer, PROMPTS[3])
    namespace = os.path.join(folder, params["remote_namespace"])
    for name in os.listdir(namespace):  # every block of the folder corrupt (the last use of it)
        with open(os.path.join(namespace, name), "r+b") as f:
            f.seek(-8, os.SEEK_END)
            f.write(b"garbage!")
    (out,) = consumer.generate([PROMPTS[3]], sampling(6, params), use_tqdm=False)
    assert out.outputs[0].finish_reason == "abort"
    assert "kv_load_failure_policy" in out.outputs[0].stop_reason
    (alone,) = producer.generate([PROMPTS[4]], sampling(4), use_tqdm=False)
    (again,) = consumer.generate([PROMPTS[4]], sampling(4), use_tqdm=False)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match="kv_load_failure_policy must be one of recompute, "
                                         "fail, got 'retry'"):
        LLM(tiny_llama, kv_transfer_config={"kv_connector": "SharedStorageConnector",
                                            "kv_load_failure_policy": "retry"})
