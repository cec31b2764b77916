"""Time to first token after a restart, on prompts whose KV the offload tier's disk level kept,
against prompts never seen: an engine with a disk level (the default model, SmolLM2-135M)
computes TRIALS random 512-token prompts and stops (writing its cache to disk); a new engine on
the same folder answers them again and as many fresh ones, `max_tokens` 1. Also prints the
disk level's load rate.

    python examples/offload/restart_ttft.py [TRIALS]
"""
import random
import statistics
import sys
import tempfile
import time

from runtime import LLM, SamplingParams

TRIALS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
FOLDER = tempfile.mkdtemp()
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
rng = random.Random(0)


def engine() -> LLM:
    return LLM(kv_cache_memory="1GiB", max_model_len=1024, kv_offloading_disk_path=FOLDER)


def prompt() -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(512)]


def ttft(llm: LLM, tokens: list[int]) -> tuple[float, list[int]]:
    started = time.perf_counter()
    out = llm.generate([tokens], FIRST_TOKEN, use_tqdm=False)[0]
    return time.perf_counter() - started, out.outputs[0].token_ids


def summary(seconds: list[float]) -> str:
    return (f"median {1000 * statistics.median(seconds):.1f} ms (min {1000 * min(seconds):.1f}, "
            f"max {1000 * max(seconds):.1f})")


first = engine()
ttft(first, prompt())  # warm-up
cached = [prompt() for _ in range(TRIALS)]
answers = [ttft(first, tokens)[1] for tokens in cached]
first.engine.core.shutdown()
del first

restarted = engine()
ttft(restarted, prompt())  # warm-up
cold = [ttft(restarted, prompt())[0] for _ in range(TRIALS)]
warm, same = [], 0
for tokens, answer in zip(cached, answers):
    seconds, tokens_out = ttft(restarted, tokens)
    same += tokens_out == answer  # bf16 with another batch shape may flip a near tie
    warm.append(seconds)
stats = restarted.engine.core.kv_connector.stats()
print(f"{TRIALS} trials of a 512-token prompt; disk hit blocks {stats['disk_hit_blocks']}; "
      f"first token as before the restart: {same} of {TRIALS}")
print("TTFT after restart, prompt never seen:", summary(cold))
print("TTFT after restart, prompt on disk:   ", summary(warm))
print(f"ratio of medians: {statistics.median(warm) / statistics.median(cold):.2f}")
print(f"disk level load: {stats['bytes_loaded'] / 1e6:.1f} MB in {stats['load_seconds']:.3f} s "
      f"= {stats['bytes_loaded'] / 1e6 / max(stats['load_seconds'], 1e-9):.0f} MB/s")
