"""Data parallel behind the server: two engine replicas serve concurrent requests correctly, and
when one dies its requests go on on the other (with the tokens of an undisturbed run) while it
restarts."""
from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from runtime import LLM, SamplingParams
from tests.server.conftest import TINY_ARGS, Server

MAX_TOKENS = 8


def prompt(i: int) -> list[int]:
    # 16+ tokens: the first block exists, so prefix affinity takes part in routing; prompts
    # 0-7 share their first block, the others differ from the first token.
    first = [1] + list(range(500, 515)) if i < 8 else [1] + list(range(600 + 20 * i, 615 + 20 * i))
    return first + [700 + i, 800 + i, 900 + i]


@pytest.fixture(scope="module")
def dp_server(tiny_llama, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("dp") / "server.log")
    server = Server([tiny_llama, *TINY_ARGS, "--data-parallel-size", "2",
                     "--served-model-name", "tiny"], log)
    yield server
    assert server.stop() == 0, server.log()


def replica_pids(server: Server) -> list[int]:
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    pids = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                pids.append(pid)
    return sorted(pids)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def complete(server: Server, tokens: list[int], max_tokens: int = MAX_TOKENS) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def test_two_replicas_serve_32_concurrent_requests(dp_server, tiny_llama):
    prompts = [prompt(i) for i in range(32)]
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="16MiB", num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    replicas = replica_pids(dp_server)
    assert len(replicas) == 2
    before = [cpu_seconds(p) for p in replicas]
    with ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(lambda p: complete(dp_server, p), prompts))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies][:2]
    assert [r.json()["choices"][0]["text"] for r in replies] == expected
    busy = [cpu_seconds(p) - b for p, b in zip(replicas, before)]
    assert min(busy) >= 0.02, f"a replica sat idle (CPU seconds {busy})"


STREAM_TOKENS = 200


def stream_lines(server: Server, tokens: list[int]):
    body = {"model": "tiny", "prompt": tokens, "max_tokens": STREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data:"):
                yield line[5:].strip()


def streamed_text(lines: list[str]) -> str:
    assert lines[-1] == "[DONE]", lines[-1]
    return "".join(json.loads(line)["choices"][0]["text"] for line in lines[:-1]
                   if json.loads(line)["choices"])


def test_a_dead_replicas_requests_go_on_on_the_other(dp_server):
    # prompts no replica has seen: no prefix affinity, so they alternate between replicas
    streams = [stream_lines(dp_server, prompt(100 + i)) for i in range(6)]
    firsts = [next(s) for s in streams]  # every request is running on one replica or the other
    victim = replica_pids(dp_server)[1]
    os.kill(victim, signal.SIGKILL)
    with ThreadPoolExecutor(6) as pool:
        ends = [[first, *rest] for first, rest in zip(firsts, pool.map(list, streams))]
    with open(dp_server.log_path) as f:
        assert "data-parallel replica 1 process exited with code -9" in f.read()
    with ThreadPoolExecutor(6) as pool:  # again, undisturbed
        again = list(pool.map(lambda i: list(stream_lines(dp_server, prompt(100 + i))),
                              range(6)))
    assert [streamed_text(e) for e in ends] == [streamed_text(e) for e in again]
    assert httpx.get(dp_server.url + "/health").status_code == 200
    with ThreadPoolExecutor(8) as pool:
        after = list(pool.map(lambda i: complete(dp_server, prompt(i)), range(8)))
    assert all(r.status_code == 200 for r in after), [r.text for r in after]
