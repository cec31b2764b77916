"""The GGUF cache of these tests lives in a temporary folder, never under ~/.cache. The CPU
kernels and the product choice keep their usual folders (linked into it), so the kernels are
not built again for these tests."""
import os
from collections.abc import Iterator

import pytest

from runtime.plugins.paths import cache_dir


@pytest.fixture(scope="session", autouse=True)
def gguf_cache_dir(tmp_path_factory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("runtime-cache")
    for shared in ("cpu_kernels", "cpu_linear"):
        cache_dir(shared).mkdir(parents=True, exist_ok=True)
        os.symlink(cache_dir(shared), path / shared)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RUNTIME_CACHE_DIR", str(path))
        yield str(path)
