"""An on-disk cache of what is derived from a GGUF file, so that only the first load parses it.

Parsing a GGUF file's metadata takes seconds (its vocabulary is tens of thousands of strings,
read field by field), and transformers does it once for the config and again for the
tokenizer. What they produce is saved under `$RUNTIME_CACHE_DIR/gguf/` (default
`~/.cache/runtime/gguf/`), in a folder per file whose key is the file's real path, size and
mtime, the cache format and the transformers version: a changed file gets a new folder.

Each part (e.g. "model", "tokenizer") is built in a temporary folder and renamed into place,
so a concurrent process sees either nothing or a complete part. A manifest records the
SHA-256 of every file of the part; a part that does not match it is discarded and rebuilt.
Where the cache cannot be written, a part is built in a temporary folder for this process.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable

import transformers

from runtime.plugins.paths import cache_dir

FORMAT_VERSION = 1
_MANIFEST = "manifest.json"
# Parts built outside the cache (it could not be written), by the folder they would have had.
_uncached: dict[str, str] = {}

logger = logging.getLogger(__name__)


def cache_root() -> str:
    """The folder that holds the GGUF cache: `gguf/` under the cache root
    (`runtime.plugins.paths`)."""
    return str(cache_dir("gguf"))


def cache_key(path: str) -> str:
    """The name of the cache folder for GGUF file `path`: its stem and a hash of what identifies it."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    identity = [FORMAT_VERSION, real, stat.st_size, stat.st_mtime_ns, transformers.__version__]
    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    return f"{os.path.splitext(os.path.basename(real))[0]}-{digest}"


def cached_part(path: str, part: str, build: Callable[[str, str], None]) -> str:
    """The folder that holds `part` of what is derived from GGUF file `path`.

    When the cache has no valid copy, `build(path, folder)` writes the part's files into the
    empty `folder`, which is then published (or, if another process was first, discarded).
    """
    folder = os.path.join(cache_root(), cache_key(path), part)
    if folder in _uncached:
        return _uncached[folder]
    if _is_valid(folder):
        return folder
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{part}-", dir=os.path.dirname(folder))
    except OSError as error:
        logger.warning("cannot write the GGUF cache (%s); %s is parsed again by every process", error, path)
        _uncached[folder] = _build_uncached(path, part, build)
        return _uncached[folder]
    try:
        logger.info("parsing %s (first load: the %s part is cached in %s)", path, part, folder)
        _build(path, staging, build)
        try:
            os.rename(staging, folder)
        except OSError:  # a folder is there: a concurrent build that got there first, or a corrupt copy
            if not _is_valid(folder):
                _discard(folder)
                os.rename(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _build(path: str, folder: str, build: Callable[[str, str], None]) -> None:
    build(path, folder)
    files = {name: _sha256(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}
    with open(os.path.join(folder, _MANIFEST), "w") as f:
        json.dump({"format": FORMAT_VERSION, "source": os.path.realpath(path), "files": files}, f, indent=1)


def _build_uncached(path: str, part: str, build: Callable[[str, str], None]) -> str:
    folder = tempfile.mkdtemp(prefix=f"runtime-gguf-{part}-")
    atexit.register(shutil.rmtree, folder, True)
    _build(path, folder, build)
    return folder


def _is_valid(folder: str) -> bool:
    """Whether `folder` is a complete part whose files are those its manifest lists."""
    try:
        with open(os.path.join(folder, _MANIFEST)) as f:
            manifest = json.load(f)
        return manifest["format"] == FORMAT_VERSION and all(
            _sha256(os.path.join(folder, name)) == digest for name, digest in manifest["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _discard(folder: str) -> None:
    """Remove `folder` if it exists, moving it aside first so that nobody sees it half removed."""
    aside = tempfile.mkdtemp(prefix=".discarded-", dir=os.path.dirname(folder))
    try:
        with contextlib.suppress(FileNotFoundError):  # another process discarded it first
            os.rename(folder, os.path.join(aside, "part"))
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _sha256(file: str) -> str:
    with open(file, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
