"""Fixtures for the plugin tests: a clean plugin environment, and a really installed plugin."""
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.plugins.manager import reset_plugin_manager

FAKE_DIST = Path(__file__).parent / "fake_plugin_dist"
ENV_VARS = ("RUNTIME_PLUGINS", "RUNTIME_DEVICE", "RUNTIME_CPU_COMPILE",
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
    root = tmp_path_factory.mktemp("fake_plugin")
    src = root / "src"  # building in place would leave build/ and *.egg-info in the repo
    shutil.copytree(FAKE_DIST, src, ignore=shutil.ignore_patterns("__pycache__", "build",
                                                                  "*.egg-info"))
    site = root / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                           "--no-build-isolation", "--quiet", "--target", str(site), str(src)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.fail(f"installing the fake plugin failed:\n{proc.stdout}\n{proc.stderr}")
    return site


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
