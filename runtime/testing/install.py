"""Installing a plugin's distribution as a user would, into a private folder, for tests."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def install_into(source: Path, root: Path) -> Path:
    """`pip install` the distribution at `source` into `root/site` (no dependencies, no index)
    and return that folder; put it on sys.path (or PYTHONPATH) to use it. The build runs on a
    copy in `root/src`, since building in place leaves build/ and *.egg-info behind."""
    src = root / "src"
    shutil.copytree(source, src, ignore=shutil.ignore_patterns("__pycache__", "build",
                                                               "*.egg-info"))
    site = root / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                           "--no-build-isolation", "--quiet", "--target", str(site), str(src)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"installing {source} failed:\n{proc.stdout}\n{proc.stderr}")
    return site
