"""Time to first token at a decode instance with the prompt's KV handed over by a prefill
instance, against computing the prompt: two `LLM` objects in one process (the default model,
SmolLM2-135M), a fresh random 512-token prompt per trial, `max_tokens` 1.

    python examples/disagg/ttft.py [TRIALS] [SharedStorageConnector | P2pTcpConnector]
"""
import random
import statistics
import sys
import tempfile
import time

from runtime import LLM, SamplingParams

TRIALS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
CONNECTOR = sys.argv[2] if len(sys.argv) > 2 else "SharedStorageConnector"
EXTRA = {"shared_storage_path": tempfile.mkdtemp()} if CONNECTOR == "SharedStorageConnector" \
    else {"kv_port": 15991}
rng = random.Random(0)


def engine(role: str) -> LLM:
    return LLM(kv_cache_memory="1GiB", max_model_len=1024, kv_transfer_config={
        "kv_connector": CONNECTOR, "kv_role": role, "kv_connector_extra_config": EXTRA})


def prompt() -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(512)]


def first_token(params: dict | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                          extra_args=None if params is None else {"kv_transfer_params": params})


def timed(llm: LLM, tokens: list[int], params: SamplingParams):
    started = time.perf_counter()
    out = llm.generate([tokens], params, use_tqdm=False)[0]
    return time.perf_counter() - started, out


def summary(seconds: list[float]) -> str:
    return (f"median {1000 * statistics.median(seconds):.1f} ms (min {1000 * min(seconds):.1f}, "
            f"max {1000 * max(seconds):.1f})")


producer, consumer = engine("kv_producer"), engine("kv_consumer")
timed(consumer, prompt(), first_token())  # warm-up
computed, loaded, prefilled = [], [], []
for _ in range(TRIALS):
    computed.append(timed(consumer, prompt(), first_token())[0])
    tokens = prompt()
    seconds, pre = timed(producer, tokens, first_token({"do_remote_decode": True}))
    prefilled.append(seconds)
    seconds, out = timed(consumer, tokens, first_token(pre.kv_transfer_params))
    loaded.append(seconds)
    assert out.outputs[0].token_ids == pre.outputs[0].token_ids
    assert out.num_cached_tokens == pre.kv_transfer_params["remote_num_tokens"]
print(f"{CONNECTOR}, {TRIALS} trials of a 512-token prompt")
print("decode TTFT, prompt computed:", summary(computed))
print("decode TTFT, KV handed over :", summary(loaded), f"({out.num_cached_tokens} tokens)")
print("prefill instance, prefill and hand-over:", summary(prefilled))
print("decode instance's connector:", consumer.engine.core.kv_connector.stats())
