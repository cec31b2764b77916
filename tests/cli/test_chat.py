"""`runtime chat` as a person uses it: streamed replies, /clear, /exit, Ctrl-C that stops a
reply but keeps the session, and --url against a running server."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from tests.server.conftest import TINY_ARGS, Server

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GREEDY = ["--temperature", "0", "--max-tokens", "6"]


def chat(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli.main", "--log-level", "WARNING",
                           "chat", *args], input=stdin, capture_output=True, text=True,
                          cwd=REPO, timeout=300)


@pytest.fixture(scope="module")
def local_replies(tiny_llama):
    done = chat(["--model", tiny_llama, *TINY_ARGS, *GREEDY], "Hello\n\n/clear\nHello\n/exit\n")
    assert done.returncode == 0, done.stderr
    return done


def test_local_chat_streams_the_greedy_reply_and_clear_forgets(local_replies, tiny_llama):
    from runtime import LLM, SamplingParams
    first, second = local_replies.stdout.splitlines()
    assert first == second  # after /clear the same question meets an empty conversation
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="16MiB", num_threads=1)
    expected = llm.chat([{"role": "user", "content": "Hello"}],
                        SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert first == expected[0].outputs[0].text.strip()
    assert "(conversation cleared)" in local_replies.stderr
    assert "Traceback" not in local_replies.stderr


def test_ctrl_c_stops_the_reply_and_keeps_the_session(tiny_llama):
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli.main", "--log-level", "WARNING", "chat",
         "--model", tiny_llama, *TINY_ARGS, "--temperature", "0", "--max-tokens", "900"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    proc.stdin.write(b"Tell me a long story\n")
    proc.stdin.flush()
    out = b""
    deadline = time.monotonic() + 240
    while len(out) < 20 and time.monotonic() < deadline:  # the reply has started streaming
        if select.select([proc.stdout], [], [], 1)[0]:
            out += os.read(proc.stdout.fileno(), 4096)
    proc.send_signal(signal.SIGINT)
    while b"[stopped]" not in out and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 1)[0]:
            out += os.read(proc.stdout.fileno(), 4096)
    rest, err = proc.communicate(b"Hello\n/exit\n", timeout=240)
    assert proc.returncode == 0, err.decode()
    assert b"[stopped]" in out and b"Traceback" not in err
    assert rest.strip(), "no reply after the interrupted one: the session did not go on"


def test_url_chats_with_a_running_server(tiny_llama, local_replies, tmp_path):
    server = Server([tiny_llama, *TINY_ARGS, "--served-model-name", "tiny", "--api-key", "k"],
                    str(tmp_path / "server.log"))
    try:
        done = chat(["--url", server.url, "--api-key", "k", *GREEDY], "Hello\n/exit\n")
        unauthorized = chat(["--url", server.url, "--api-key", "wrong"], "Hello\n")
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == local_replies.stdout.splitlines()[0]
    assert unauthorized.returncode == 2 and "HTTP 401" in unauthorized.stderr
    assert "Traceback" not in unauthorized.stderr
    refused = chat(["--url", server.url], "Hello\n")  # the server is gone now
    assert refused.returncode == 2 and refused.stderr.startswith("error: cannot reach")


def test_a_terminal_gets_line_editing_and_history(tiny_llama, tmp_path):
    """On a terminal, prompt_toolkit reads the lines: Up brings back the last one (no literal
    ^[[A), and the history is kept in the history file."""
    import fcntl
    import pty
    import struct
    import termios
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
    history_file = tmp_path / "history"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli.main", "--log-level", "WARNING", "chat",
         "--model", tiny_llama, *TINY_ARGS, *GREEDY, "--history-file", str(history_file)],
        stdin=follower, stdout=follower, stderr=follower, cwd=REPO, env=env)
    os.close(follower)
    screen = bytearray()
    prompt_start = b"\x1b[?2004h"  # prompt_toolkit turns bracketed paste on for each prompt

    def wait_for(condition) -> bool:
        deadline = time.monotonic() + 240
        while not condition() and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                screen.extend(os.read(leader, 4096))
        return condition()

    try:
        assert wait_for(lambda: screen.count(prompt_start) == 1), bytes(screen)
        os.write(leader, b"Hello\r")
        assert wait_for(lambda: screen.count(prompt_start) == 2), bytes(screen)
        mark = len(screen)
        os.write(leader, b"\x1b[A")  # Up
        assert wait_for(lambda: b"Hello" in screen[mark:]), bytes(screen[mark:])
        os.write(leader, b"\r")
        assert wait_for(lambda: screen.count(prompt_start) == 3), bytes(screen)
        os.write(leader, b"/exit\r")
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        os.close(leader)
    assert b"^[[A" not in screen and b"Traceback" not in screen
    history = history_file.read_text()
    assert "+Hello" in history and "+/exit" in history
