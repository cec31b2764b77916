"""A supervised engine core: killed mid-load, its streams end with an error event at once and a
fresh core serves again; killed three times fast, the server exits non-zero. Also: the port is
checked before loading, and --shutdown-timeout ends streams with the error event."""
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

import httpx
import pytest

from tests.server.conftest import REPO, TINY_ARGS, Server, wait_for

RECOVERY_S = 30
LONG = {"prompt": "A long story:", "max_tokens": 1000, "ignore_eos": True, "stream": True}


def _last_event_after_kill(server: Server, kill: threading.Event, out: list) -> None:
    """Read one stream; record (seconds from the kill to its end, its last data line)."""
    with httpx.stream("POST", server.url + "/v1/completions", json=LONG, timeout=60) as reply:
        last = None
        for line in reply.iter_lines():
            if line.startswith("data:"):
                last = line[5:].strip()
                if not kill.is_set():
                    out.append(None)  # a token came: this stream is running
    out.append((time.monotonic(), last))


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("recovery") / "server.log")
    server = Server([tiny_llama, *TINY_ARGS, "--served-model-name", "tiny",
                     "--shutdown-timeout", "1", "--enable-log-requests"], log)
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


def test_killed_core_fails_streams_at_once_and_comes_back(server):
    kill, results = threading.Event(), [[] for _ in range(4)]
    threads = [threading.Thread(target=_last_event_after_kill, args=(server, kill, out))
               for out in results]
    for t in threads:
        t.start()
    assert wait_for(lambda: all(results), 60), "the streams did not start"
    old = server.core_pid()
    killed_at = time.monotonic()
    kill.set()
    os.kill(old, signal.SIGKILL)
    for t in threads:
        t.join(10)
    for out in results:
        ended_at, last = out[-1]
        assert ended_at - killed_at < 1.0, ended_at - killed_at
        assert "error" in json.loads(last), last
    assert httpx.get(server.url + "/health").status_code == 503
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, RECOVERY_S)
    assert time.monotonic() - killed_at < RECOVERY_S
    done = httpx.post(server.url + "/v1/completions", json={"prompt": "again", "max_tokens": 3},
                      timeout=60)
    assert done.status_code == 200, done.text
    assert server.core_pid() != old
    assert server.metric("runtime:engine_core_restarts_total") == 1
    assert "request cmpl-" in server.log()  # --enable-log-requests


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
