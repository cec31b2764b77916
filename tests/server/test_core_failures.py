"""The engine core's loop when a request makes it raise (validation would have refused it; here
it is sent to the core directly): the batch of the step that raised is finished and reported in
RequestsFailed, and the core keeps stepping."""
from __future__ import annotations

import os
import threading

import msgspec
import pytest
import zmq

from runtime.config import EngineConfig
from runtime.engine.core_proc import (AddRequests, CoreLoop, CoreRequest, FromCore, Outputs,
                                      RequestsFailed, Shutdown)
from runtime.engine.llm_engine import build_core
from runtime.model_spec import ModelSpec
from runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def core(tiny_llama):
    config = EngineConfig.from_kwargs(model=tiny_llama, dtype="float32",
                                      kv_cache_memory="16MiB", num_threads=1)
    core = build_core(config, ModelSpec.resolve(config))
    yield core
    core.shutdown()


def _request(request_id: str, prompt: list[int]) -> CoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True).with_eos(2)
    return CoreRequest(request_id, prompt, params, 6, 0, 0.0, request_id, 0, None)


def _run(core, messages: list) -> dict[str, object]:
    """Drive a CoreLoop over in-process sockets; returns, per request, its tokens or error."""
    context = zmq.Context()
    to_core, inbox = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    outbox, from_core = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    to_core.bind("inproc://in")
    inbox.connect("inproc://in")
    from_core.bind("inproc://out")
    outbox.connect("inproc://out")
    loop = CoreLoop(core, inbox, outbox, msgspec.msgpack.Encoder(), os.getppid())
    thread = threading.Thread(target=loop.run)
    thread.start()
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FromCore)
    for message in messages:
        to_core.send(encoder.encode(message))
    results: dict[str, object] = {}
    try:
        while from_core.poll(10_000 if core.has_unfinished() or not results else 500):
            message = decoder.decode(from_core.recv())
            if isinstance(message, RequestsFailed):
                for request_id in message.request_ids:
                    results[request_id] = message.error
            elif isinstance(message, Outputs):
                for out in message.outputs:
                    results.setdefault(out.request_id, [])
                    if isinstance(results[out.request_id], list):
                        results[out.request_id] += out.new_token_ids
    finally:
        to_core.send(encoder.encode(Shutdown()))
        thread.join(30)
        for sock in (to_core, inbox, outbox, from_core):
            sock.close(linger=0)
        context.term()
    return results


def test_a_request_the_step_raises_on_fails_its_batch_and_the_core_goes_on(core):
    # A token id past the vocabulary (validation refuses it): the embedding lookup raises.
    results = _run(core, [AddRequests([_request("bad", [1, 5, 10**6])])])
    assert isinstance(results["bad"], str) and "IndexError" in results["bad"], results
    after = _run(core, [AddRequests([_request("good", [1, 5, 9, 12])])])
    assert after["good"] and len(after["good"]) == 6, after  # the core stepped on
