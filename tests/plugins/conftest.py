"""Fixtures for the plugin tests: a clean plugin environment, and a really installed plugin."""
import importlib
import sys
from pathlib import Path

import pytest

from runtime.plugins.manager import reset_plugin_manager
from runtime.testing.install import install_into

FAKE_DIST = Path(__file__).parent / "fake_plugin_dist"
ENV_VARS = ("RUNTIME_PLUGINS", "RUNTIME_DEVICE",
            "RUNTIME_FAKE_PRIORITY", "RUNTIME_FAKE_USABLE")


@pytest.fixture(autouse=True)
def clean_plugin_env(monkeypatch):
    """Each test starts from no plugin env vars and a manager that rediscovers plugins."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture(scope="session")
def fake_plugin_site(tmp_path_factory) -> Path:
    """`pip install` the fake plugin distribution into a private directory, once per session."""
    return install_into(FAKE_DIST, tmp_path_factory.mktemp("fake_plugin"))


@pytest.fixture
def fake_plugin(fake_plugin_site):
    """Put the installed fake plugin on sys.path for one test, then take it away again."""
    sys.path.insert(0, str(fake_plugin_site))
    importlib.invalidate_caches()
    reset_plugin_manager()
    yield
    sys.path.remove(str(fake_plugin_site))
    for name in [m for m in sys.modules if m.split(".")[0] == "runtime_fake_platform"]:
        del sys.modules[name]
    importlib.invalidate_caches()
    reset_plugin_manager()
