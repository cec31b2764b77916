"""Real `runtime serve` processes on loopback ports, for the official clients to drive."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "test-key"
STARTUP_TIMEOUT_S = 240  # the 2-core CI machine is shared; loading is usually ~20 s
SHUTDOWN_TIMEOUT_S = 60
TINY_ARGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--num-threads", "1"]
# for the tests of slow clients (a slow head or body is cut off after these)
SHORT_TIMEOUTS = ["--header-timeout", "5", "--body-timeout", "5"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m runtime.cli.main serve ARGS` on 127.0.0.1, its log in `log_path`, with `env`
    added to the environment."""

    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None
                 ) -> None:
        self.port = free_port()
        scheme = "https" if "--ssl-certfile" in args else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self._terminated = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli.main", "--log-level", "INFO", "serve",
             "--host", "127.0.0.1", "--port", str(self.port), *args],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})})
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not start:\n{self.log()}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2, verify=False).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def core_pid(self) -> int:
        """The engine core process: the server's child that multiprocessing spawned."""
        pid = self.live_core_pid()
        if pid is None:
            raise AssertionError("no engine core among the server's children")
        return pid

    def live_core_pid(self) -> int | None:
        """The running (not zombie) engine core's pid, if there is one: the last core the log
        says was started, among the server's children that multiprocessing spawned (grammar
        check workers are spawned too)."""
        with open(self.log_path) as f:
            started = [int(p) for p in re.findall(r": process (\d+) starting", f.read())]
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            children = {int(p) for p in f.read().split()}
        for pid in reversed(started):
            if pid not in children:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        return pid
            except FileNotFoundError:  # it exited meanwhile
                continue
        return None

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample on /metrics (0 when absent)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line
                                                   for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def terminate(self) -> None:
        """Ask for a graceful shutdown (SIGTERM), once."""
        if not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        """A graceful shutdown; returns the exit code."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"the server ignored SIGTERM:\n{self.log()}")
        self._log.close()
        return self.proc.returncode


def wait_for(condition, timeout: float = 30.0, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


@pytest.fixture(scope="session")
def tiny_server(tiny_llama, tmp_path_factory):
    """The tiny random Llama behind an API key; shut down gracefully at the end."""
    log = str(tmp_path_factory.mktemp("server") / "tiny.log")
    server = Server([tiny_llama, *TINY_ARGS, "--served-model-name", "tiny", "--api-key",
                     API_KEY, *SHORT_TIMEOUTS], log)
    yield server
    # A graceful shutdown lets the request in flight when SIGTERM arrives finish.
    core = server.core_pid()
    body = {"prompt": "In flight", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as reply:
        events = (line for line in reply.iter_lines() if line.startswith("data:"))
        next(events)
        server.terminate()
        rest = list(events)
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2], rest[-2:]
    assert server.stop() == 0, server.log()
    assert wait_for(lambda: not os.path.exists(f"/proc/{core}"), 10), \
        "the engine core outlived the server"


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture
def client(tiny_server):
    import openai
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """The embedded default model (SmolLM2-135M-Instruct), reading hermes tool calls."""
    server = Server(["--kv-cache-memory", "128MiB", "--max-model-len", "2048", "--num-threads",
                     "1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                    str(tmp_path_factory.mktemp("smollm2") / "server.log"))
    yield server
    assert server.stop() == 0, server.log()
