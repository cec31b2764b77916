"""The docs run: every shell and Python block of README.md and docs/*.md marked runnable (an
`<!-- runnable -->` line right before its fence) runs here on the CPU, so the docs cannot drift
from the code.

Two substitutions keep the run short and offline: `pip install ...` steps are skipped (the
test environment is the one the README installs), and generation lengths are capped at
MAX_TOKENS (`--max-tokens N` and `max_tokens=N`).
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKER = "<!-- runnable -->"
MAX_TOKENS = 8
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(where, language, code) of each marked block."""
    blocks = []
    for path in ["README.md", *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]:
        path = os.path.join(REPO, path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for match in FENCE.finditer(text):
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            if before.strip() == MARKER:
                line = text.count("\n", 0, match.start()) + 1
                where = f"{os.path.relpath(path, REPO)}:{line}"
                blocks.append((where, match.group(1), match.group(2)))
    return blocks


def shortened(code: str) -> str:
    code = re.sub(r"--max-tokens \d+", f"--max-tokens {MAX_TOKENS}", code)
    return re.sub(r"max_tokens=\d+", f"max_tokens={MAX_TOKENS}", code)


def without_installs(script: str) -> str:
    """The shell script less its `pip install` steps (each `&&`-joined command on its own)."""
    script = script.replace("\\\n", " ")
    lines = []
    for line in script.splitlines():
        steps = [s.strip() for s in line.split("&&")]
        kept = [s for s in steps if s and not s.startswith("pip install")]
        if kept:
            lines.append(" && ".join(kept))
    return "\n".join(lines)


BLOCKS = runnable_blocks()


def test_the_docs_mark_runnable_blocks():
    where = {w.split(":")[0] for w, _, _ in BLOCKS}
    assert {"README.md", "docs/speculative.md"} <= where, where


@pytest.mark.parametrize("where,language,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_runnable_block(where, language, code):
    code = shortened(code)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep +
           os.environ.get("PATH", ""), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    if language in ("bash", "sh", "shell"):
        argv = ["bash", "-euo", "pipefail", "-c", without_installs(code)]
    elif language == "python":
        argv = [sys.executable, "-c", code]
    else:
        pytest.fail(f"{where}: a runnable block must be bash or python, got {language!r}")
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, f"{where} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), f"{where} printed nothing"
