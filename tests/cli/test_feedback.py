"""What a person sees: progress bars on a terminal (and none in a pipe), and errors they can act
on instead of tracebacks."""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

from runtime.cli.main import main
from tests.server.conftest import TINY_ARGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate(model: str, *extra: str, terminal: bool) -> tuple[int, str]:
    """`runtime generate` with stderr on a pseudo-terminal (or a pipe); returns its exit code
    and stderr."""
    argv = [sys.executable, "-m", "runtime.cli.main", "--log-level", "WARNING", "generate",
            "Hello", "Hi", "--model", model, *TINY_ARGS, "--max-tokens", "4", *extra]
    if not terminal:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=300)
        return done.returncode, done.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=follower, cwd=REPO)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return proc.wait(timeout=300), b"".join(chunks).decode(errors="replace")


def test_progress_bars_on_a_terminal_only(tiny_llama):
    code, shown = generate(tiny_llama, terminal=True)
    assert code == 0, shown
    assert "Loading safetensors weights" in shown
    assert "Processed prompts" in shown and "2/2" in shown
    assert "est. speed input:" in shown and "output:" in shown and "toks/s" in shown
    code, piped = generate(tiny_llama, terminal=False)
    assert code == 0 and "Processed prompts" not in piped and "Loading" not in piped, piped


def test_kv_budget_above_free_memory_is_refused_with_the_numbers(tiny_llama, capsys):
    code = main(["generate", "x", "--model", tiny_llama, *TINY_ARGS[:2],
                 "--kv-cache-memory-bytes", "1TiB"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "asks for 1024.00 GiB but this host has" in err and "GiB of memory available" in err


def test_user_mistakes_get_one_line_not_a_traceback(tiny_llama, tmp_path, capsys):
    cases = [["--model", str(tmp_path)],
             ["--model", tiny_llama, "--max-model-len", "999999"],
             ["--model", tiny_llama, "--generation-config", str(tmp_path)],
             ["--model", tiny_llama, "--speculative-config", "{bad json"]]
    for argv in cases:
        assert main(["generate", "x", *argv, *TINY_ARGS]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, (argv, err)
    for text in ("model: [unclosed", "- a list"):
        (tmp_path / "config.yaml").write_text(text)
        assert main(["serve", "--config", str(tmp_path / "config.yaml")]) == 2, text
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, (text, err)
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--tokenizer", tiny_llama,
                 "--num-prompts", "1", "--input-len", "4", "--output-len", "2"]) == 2
    assert "error: cannot list the models of http://127.0.0.1:9" in capsys.readouterr().err


def test_ctrl_c_during_generation_exits_cleanly(tiny_llama):
    import signal
    import time
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli.main", "--log-level", "INFO", "generate", "Tell me",
         "--model", tiny_llama, *TINY_ARGS, "--max-tokens", "1000", "--temperature", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO,
        # a suite launched in the background inherits SIGINT ignored; the user's terminal does not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    log = b""
    deadline = time.monotonic() + 240
    while b"KV cache:" not in log and time.monotonic() < deadline:  # the engine is up
        log += proc.stderr.readline()
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    err = (log + rest).decode()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err


def test_a_tpu_kv_budget_above_free_memory_is_refused(monkeypatch):
    """The TPU platform asks torch_xla for its memory (faked here, at that boundary only)."""
    import types

    import pytest

    from runtime.platforms.tpu.platform import GiB, TpuPlatform
    xla_model = types.ModuleType("torch_xla.core.xla_model")
    xla_model.xla_device = lambda: "xla:0"
    xla_model.get_memory_info = lambda device: {"bytes_used": 2 * GiB, "bytes_limit": 16 * GiB}
    core = types.ModuleType("torch_xla.core")
    core.xla_model = xla_model
    torch_xla = types.ModuleType("torch_xla")
    torch_xla.core = core
    for name, module in (("torch_xla", torch_xla), ("torch_xla.core", core),
                         ("torch_xla.core.xla_model", xla_model)):
        monkeypatch.setitem(sys.modules, name, module)
    tpu = TpuPlatform(1)
    assert tpu.kv_cache_memory_bytes(4 * GiB, 0) == 4 * GiB
    with pytest.raises(ValueError, match="asks for 20.00 GiB but the TPU has 14.00 GiB free"):
        tpu.kv_cache_memory_bytes(20 * GiB, 0)
