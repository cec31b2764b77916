"""The GGUF cache of these tests lives in a temporary folder, never under ~/.cache."""
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def gguf_cache_dir(tmp_path_factory) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as patch:
        path = str(tmp_path_factory.mktemp("runtime-cache"))
        patch.setenv("RUNTIME_CACHE_DIR", path)
        yield path
