"""Selection rules on plugins registered in-process (pluggy's own `register`), no entry points."""
import pytest
import torch

from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import Platform, PlatformCandidate
from runtime.plugins.manager import get_plugin_manager
from runtime.plugins.selection import PlatformError, detect_platforms, explain_platforms, select_platform


@pytest.fixture(autouse=True)
def cpu_plugin_only(monkeypatch):
    """Only the CPU platform is built in here; the accelerator platforms have their own tests."""
    monkeypatch.setenv("RUNTIME_PLUGINS", "cpu")


class HostPlatform(Platform):
    device_type = "cpu"

    def __init__(self, name):
        self.name = name

    def device(self, local_rank=0):
        return torch.device("cpu")

    def default_dtype(self):
        return torch.float32

    def kv_cache_memory_bytes(self, requested, model_bytes):
        return requested or 1 << 20


class Offers:
    def __init__(self, *candidates):
        self.candidates = list(candidates)

    @hookimpl
    def runtime_detect_platforms(self):
        return self.candidates


class Raises:
    @hookimpl
    def runtime_detect_platforms(self):
        raise RuntimeError("driver crashed")


class Malformed:
    @hookimpl
    def runtime_detect_platforms(self):
        return ["cuda"]


def test_cpu_alone_is_selected():
    assert select_platform().name == "cpu"
    assert explain_platforms() == [{
        "name": "cpu", "plugin": "cpu", "priority": 0, "detected": True, "reason": "",
        "active": True, "why": "highest priority (0) among usable candidates"}]


def test_a_failing_detection_is_an_unusable_candidate():
    pm = get_plugin_manager()
    pm.register(Raises(), name="raiser")
    pm.register(Malformed(), name="malformed")
    by_plugin = {c.plugin: c for c in detect_platforms()}
    assert by_plugin["raiser"].platform is None
    assert by_plugin["raiser"].reason == "detection raised RuntimeError: driver crashed"
    assert "'cuda', not a PlatformCandidate" in by_plugin["malformed"].reason
    assert select_platform().name == "cpu"


def test_unusable_higher_priority_is_skipped():
    get_plugin_manager().register(
        Offers(PlatformCandidate("accel", None, 100, "no accel driver")), name="accel_plugin")
    assert select_platform().name == "cpu"
    rows = {row["name"]: row for row in explain_platforms()}
    assert rows["accel"]["why"] == "not detected: no accel driver"
    assert [row["name"] for row in explain_platforms()] == ["accel", "cpu"]  # best first


def test_same_name_from_two_plugins_tie():
    pm = get_plugin_manager()
    pm.register(Offers(PlatformCandidate("host", HostPlatform("host"), 5)), name="a")
    pm.register(Offers(PlatformCandidate("host", HostPlatform("host"), 5)), name="b")
    with pytest.raises(PlatformError) as err:
        select_platform("host")
    msg = str(err.value)
    assert "host (plugin a), host (plugin b) tie at priority 5" in msg
    assert "keep only one of these plugins with RUNTIME_PLUGINS" in msg


def test_forced_name_picks_the_best_of_its_candidates():
    pm = get_plugin_manager()
    slow, fast = HostPlatform("host"), HostPlatform("host")
    pm.register(Offers(PlatformCandidate("host", slow, 1)), name="a")
    pm.register(Offers(PlatformCandidate("host", fast, 2, plugin="fast_wheel")), name="b")
    assert select_platform("host") is fast
    rows = explain_platforms("host")
    assert [(r["plugin"], r["active"]) for r in rows] == [
        ("fast_wheel", True), ("a", False), ("cpu", False)]
    assert rows[1]["why"] == "lower priority (1 < 2)"
