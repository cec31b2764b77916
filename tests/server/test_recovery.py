"""A supervised engine core: killed (SIGKILL) or frozen (SIGSTOP, found by the stall watchdog)
under 16 mixed streams, every stream goes on on the fresh core and ends with the text of an
undisturbed run; a request that kills the core twice in a row fails alone; killed three times
fast, the server exits non-zero. Also: the port is checked before loading, and
--shutdown-timeout ends streams with the error event."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict

import httpx
import pytest

from runtime.engine.core_proc import KILL_ON_TOKEN_ENV
from tests.lora.lora_reference import ADAPTERS, save_adapter
from tests.server.conftest import REPO, TINY_ARGS, Server, wait_for

RECOVERY_S = 60
STALL_TIMEOUT_S = 4
POISON = 48999  # a prompt holding this token id kills the core (the server's test fault hook)
LONG = {"prompt": "A long story:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
N = 120  # tokens per stream: enough that none ends before the last has begun
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
GREEDY = {"temperature": 0, "stream": True}


def _completion(prompt: str, **extra) -> tuple[str, dict]:
    return "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": N, **GREEDY,
                               "ignore_eos": True, **extra}


def _chat(**extra) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": N,
                                    **GREEDY, "ignore_eos": True, **extra}


# 16 streams: plain (greedy and seeded), n=2, LoRA, json_schema, tools, Responses, Anthropic
STREAMS = [
    _completion("Once upon a time"), _completion("The capital of France"),
    _completion("def fibonacci(n):"), _completion("1, 2, 3,"),
    _completion("A seeded story:", temperature=1.0, seed=11),
    _completion("Two seeded tales:", temperature=0.8, seed=5, n=2),
    _completion("An adapted story:", model="qv"),
    _completion("An adapted, seeded story:", model="qv", temperature=1.0, seed=3),
    _chat(response_format={"type": "json_schema",
                           "json_schema": {"name": "person", "schema": SCHEMA}}),
    _chat(structured_outputs={"json": SCHEMA}, seed=2, temperature=0.7),
    _chat(tools=TOOLS, tool_choice="required"),
    _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    ("/v1/responses", {"model": "tiny", "input": "Tell me a story.", "max_output_tokens": N,
                       **GREEDY}),
    ("/v1/responses", {"model": "tiny", "input": "Tell me a joke.", "max_output_tokens": N,
                       **GREEDY}),
    ("/v1/messages", {"model": "tiny", "messages": ASK, "max_tokens": N, **GREEDY}),
    ("/v1/messages", {"model": "tiny", "max_tokens": N, **GREEDY,
                      "messages": [{"role": "user", "content": "Say something."}]}),
]


def _pieces(data: dict) -> list[tuple[int, str]]:
    """(choice index, generated text) pieces of one event of any of the routes."""
    if "choices" in data:
        pieces = []
        for choice in data["choices"]:
            delta = choice.get("delta", {})
            text = choice.get("text") or delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                text += call["function"].get("name", "") + call["function"].get("arguments", "")
            pieces.append((choice["index"], text))
        return pieces
    if data.get("type", "").endswith(".delta") and isinstance(data.get("delta"), str):
        return [(0, data["delta"])]  # Responses
    delta = data.get("delta") if data.get("type") == "content_block_delta" else None
    if delta is not None:  # Anthropic
        return [(0, delta.get("text") or delta.get("partial_json") or "")]
    return []


class Stream(threading.Thread):
    """One streamed request, read to its end: its text per choice, its errors."""

    def __init__(self, url: str, route: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.route, self.body = url, route, body
        self.text: dict[int, str] = defaultdict(str)
        self.events = 0
        self.errors: list[str] = []
        self.done = False
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + self.route, json=self.body,
                              timeout=RECOVERY_S) as reply:
                if reply.status_code != 200:
                    self.errors.append(f"{reply.status_code} {reply.read()!r}")
                    return
                for line in reply.iter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[5:])
                    if "error" in data or data.get("type") in ("error", "response.failed"):
                        self.errors.append(line)
                    for index, text in _pieces(data):
                        self.text[index] += text
                        self.events += 1
        except httpx.HTTPError as e:
            self.errors.append(repr(e))
        finally:
            self.done = True


def _run_all(server: Server) -> list[Stream]:
    streams = [Stream(server.url, route, body) for route, body in STREAMS]
    for s in streams:
        s.join(RECOVERY_S)
    return streams


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("recovery")
    adapter = save_adapter(tiny_llama, str(root / "qv"), seed=3, **ADAPTERS["qv"])
    os.environ[KILL_ON_TOKEN_ENV] = str(POISON)
    try:
        server = Server([tiny_llama, *TINY_ARGS, "--served-model-name", "tiny",
                         "--shutdown-timeout", "1", "--enable-log-requests",
                         "--enable-lora", "--lora-modules", f"qv={adapter}",
                         "--engine-stall-timeout", str(STALL_TIMEOUT_S),
                         "--max-core-restarts", "8"], str(root / "server.log"))
    finally:
        del os.environ[KILL_ON_TOKEN_ENV]
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


@pytest.fixture(scope="module")
def undisturbed(server) -> list[dict[int, str]]:
    streams = _run_all(server)
    for s in streams:
        assert s.done and not s.errors and s.text, (s.route, s.body, s.errors)
    return [dict(s.text) for s in streams]


def _disturbed(server: Server, disturb) -> list[Stream]:
    """The 16 streams again, `disturb(core pid)` once every one of them has begun."""
    streams = [Stream(server.url, route, body) for route, body in STREAMS]
    assert wait_for(lambda: all(s.events for s in streams), RECOVERY_S), \
        [(s.route, s.errors) for s in streams if not s.events]
    assert not any(s.done for s in streams), "a stream ended before the core was disturbed"
    old = server.core_pid()
    disturb(old)
    for s in streams:
        s.join(RECOVERY_S)
    assert server.core_pid() != old
    return streams


def _same_as_undisturbed(streams: list[Stream], undisturbed: list[dict[int, str]]) -> None:
    for s, expected in zip(streams, undisturbed):
        assert s.done and not s.errors, (s.route, s.body, s.errors)
        assert dict(s.text) == expected, (s.route, s.body)


def test_killed_core_loses_no_stream(server, undisturbed):
    restarts = server.metric("runtime:engine_core_restarts_total")

    def kill(pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 503, 5)
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and refused.headers["retry-after"]

    _same_as_undisturbed(_disturbed(server, kill), undisturbed)
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.metric("runtime:engine_core_restarts_total") == restarts + 1
    assert "request cmpl-" in server.log()  # --enable-log-requests


def test_frozen_core_is_found_by_the_watchdog_and_loses_no_stream(server, undisturbed):
    health = []

    def freeze(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 503,
                        STALL_TIMEOUT_S + 10)
        health.append(httpx.get(server.url + "/health").json()["error"]["message"])

    _same_as_undisturbed(_disturbed(server, freeze), undisturbed)
    assert "stopped stepping" in health[0], health


def test_a_request_that_kills_the_core_twice_fails_alone(server):
    others = [Stream(server.url, *_completion(f"Innocent {i}:")) for i in range(2)]
    assert wait_for(lambda: all(s.events for s in others), RECOVERY_S)
    poison = httpx.post(server.url + "/v1/completions",
                        json={"model": "tiny", "prompt": [1, POISON, 2], "max_tokens": 4},
                        timeout=4 * RECOVERY_S)
    assert poison.status_code == 500, poison.text
    assert "died twice in a row" in poison.json()["error"]["message"], poison.text
    for s in others:
        s.join(RECOVERY_S)
        assert s.done and not s.errors and len(s.text[0]) > 0, s.errors
    assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, RECOVERY_S)


def test_shutdown_timeout_ends_streams_with_the_error_event(server):
    with httpx.stream("POST", server.url + "/v1/completions", json=LONG, timeout=60) as reply:
        events = (line for line in reply.iter_lines() if line.startswith("data:"))
        next(events)
        server.terminate()
        rest = list(events)
    assert "shutting down" in json.loads(rest[-1][5:])["error"]["message"], rest[-1]
    assert server.stop() == 0, server.log()


def _self_signed(folder) -> tuple[str, str]:
    key, cert = str(folder / "key.pem"), str(folder / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    return key, cert


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl for a certificate")
def test_three_fast_kills_make_the_server_exit_non_zero(tiny_llama, tmp_path):
    """Also HTTPS, --root-path and --api-key-scope all on this server, before the kills."""
    key, cert = _self_signed(tmp_path)
    server = Server([tiny_llama, *TINY_ARGS, "--max-core-restarts", "2", "--ssl-keyfile", key,
                     "--ssl-certfile", cert, "--root-path", "/api", "--api-key", "k",
                     "--api-key-scope", "all", "--uvicorn-log-level", "warning"],
                    str(tmp_path / "server.log"))
    try:
        assert server.url.startswith("https://")
        with httpx.Client(base_url=server.url, verify=False) as https:
            assert https.get("/metrics").status_code == 401  # scope "all"
            assert https.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
            assert https.get("/health").status_code == 200
            assert https.get("/openapi.json").json()["servers"] == [{"url": "/api"}]
        killed: set[int] = set()
        for _ in range(3):
            assert wait_for(lambda: server.proc.poll() is None
                            and (server.live_core_pid() or 0) not in killed | {0}, RECOVERY_S)
            pid = server.live_core_pid()
            killed.add(pid)
            os.kill(pid, signal.SIGKILL)
        assert server.proc.wait(RECOVERY_S) == 1, server.log()
        assert "not restarted again" in server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_busy_port_fails_before_the_model_loads(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "runtime.cli.main", "serve", tiny_llama, "--port", str(port)],
            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr
    assert "KV cache" not in result.stderr  # nothing was loaded
    assert time.monotonic() - started < 60
