"""A real installed distribution declaring `runtime.plugins` entry points, end to end."""
import pytest
import torch

from runtime.plugins.manager import discovered_plugins, get_plugin_manager
from runtime.plugins.selection import PlatformError, explain_platforms, select_platform
from runtime.platforms.cpu.platform import CpuPlatform

pytestmark = pytest.mark.usefixtures("fake_plugin")


def _records():
    return {r.name: r for r in discovered_plugins()}


def test_entry_points_are_discovered_and_loaded():
    records = _records()
    assert records["cpu"].source == "builtin" and records["cpu"].loaded
    fake = records["fake"]
    assert (fake.source, fake.loaded, fake.target) == ("runtime-fake-platform", True,
                                                       "runtime_fake_platform")
    assert get_plugin_manager().get_plugin("fake") is not None


def test_broken_plugins_are_recorded_not_fatal():
    records = _records()
    broken, future, typo = records["fake_broken"], records["fake_future"], records["fake_typo"]
    assert not broken.loaded and "ImportError" in broken.reason and "libfakedev.so" in broken.reason
    assert not future.loaded and "hook API version 999" in future.reason
    assert not typo.loaded and "runtime_detect_platform" in typo.reason
    assert get_plugin_manager().get_plugin("fake_typo") is None


def test_hooks_of_the_plugin_are_called():
    hook = get_plugin_manager().hook
    models = {}
    for answer in hook.runtime_register_models():
        models.update(answer)
    assert models == {"FakeForCausalLM": "runtime_fake_platform:FakeModel"}  # not fake_future's
    op = hook.runtime_custom_op(platform=CpuPlatform(), name="fake_op")
    assert torch.equal(op(torch.zeros(2)), torch.ones(2))
    assert hook.runtime_custom_op(platform=CpuPlatform(), name="no_such_op") is None
    names = {row["name"]: row for row in explain_platforms()}
    assert names["fakedev"]["plugin"] == "fake" and names["fakedev"]["detected"]


def test_higher_priority_wins():
    platform = select_platform()
    assert platform.name == "fakedev" and platform.device(0) == torch.device("cpu")
    rows = {row["name"]: row for row in explain_platforms()}
    assert rows["fakedev"]["active"] and "highest priority (10)" in rows["fakedev"]["why"]
    assert not rows["cpu"]["active"] and rows["cpu"]["why"] == "lower priority (0 < 10)"


def test_lower_priority_loses(monkeypatch):
    monkeypatch.setenv("RUNTIME_FAKE_PRIORITY", "-5")
    assert select_platform().name == "cpu"


def test_tie_at_top_priority_is_ambiguous(monkeypatch):
    monkeypatch.setenv("RUNTIME_FAKE_PRIORITY", "0")
    with pytest.raises(PlatformError) as err:
        select_platform()
    msg = str(err.value)
    assert "ambiguous" in msg and "cpu (plugin cpu)" in msg and "fakedev (plugin fake)" in msg
    assert "--device NAME" in msg
    assert not any(row["active"] for row in explain_platforms())


def test_forcing_a_platform(monkeypatch):
    monkeypatch.setenv("RUNTIME_FAKE_PRIORITY", "0")  # forcing also settles a tie
    assert select_platform("cpu").name == "cpu"
    assert select_platform("fakedev").name == "fakedev"
    monkeypatch.setenv("RUNTIME_DEVICE", "fakedev")
    assert select_platform().name == "fakedev"
    rows = {row["name"]: row for row in explain_platforms()}
    assert rows["fakedev"]["why"] == "forced (RUNTIME_DEVICE=fakedev)"
    assert rows["cpu"]["why"] == "not the forced one (RUNTIME_DEVICE=fakedev)"
    assert select_platform("cpu").name == "cpu"  # the argument beats the env var


def test_unknown_forced_name_lists_every_candidate():
    with pytest.raises(PlatformError) as err:
        select_platform("nosuch")
    msg = str(err.value)
    assert "no platform named 'nosuch'" in msg
    assert "available: cpu, cuda, fakedev, rocm, tpu, xpu" in msg
    assert "- cpu (plugin cpu, priority 0): not the forced one" in msg
    assert "- fakedev (plugin fake, priority 10): not the forced one" in msg
    assert "fake_broken" in msg and "libfakedev.so" in msg  # plugins that did not load, too


def test_forcing_an_unusable_platform(monkeypatch):
    monkeypatch.setenv("RUNTIME_FAKE_USABLE", "0")
    assert select_platform().name == "cpu"
    with pytest.raises(PlatformError, match="platform 'fakedev' .* is not usable") as err:
        select_platform("fakedev")
    assert "not detected: no fake device attached" in str(err.value)


def test_runtime_plugins_excludes_the_others(monkeypatch):
    monkeypatch.setenv("RUNTIME_PLUGINS", "cpu")
    records = _records()
    assert records["cpu"].loaded
    for name in ("fake", "fake_broken", "fake_future", "fake_typo"):
        assert not records[name].loaded
        assert records[name].reason == "excluded by RUNTIME_PLUGINS"
    assert [row["name"] for row in explain_platforms()] == ["cpu"]
    assert select_platform().name == "cpu"
    with pytest.raises(PlatformError, match="available: cpu"):
        select_platform("fakedev")


def test_nothing_usable_names_every_candidate_and_reason(monkeypatch):
    monkeypatch.setenv("RUNTIME_PLUGINS", "fake, typo_in_name")
    monkeypatch.setenv("RUNTIME_FAKE_USABLE", "0")
    with pytest.raises(PlatformError) as err:
        select_platform()
    msg = str(err.value)
    assert msg.startswith("no usable platform.")
    assert "- fakedev (plugin fake, priority 10): not detected: no fake device attached" in msg
    assert "- cpu (builtin): excluded by RUNTIME_PLUGINS" in msg
    assert "- typo_in_name (RUNTIME_PLUGINS): named in RUNTIME_PLUGINS but no such plugin" in msg
    assert "pip install runtime[cpu]" in msg and "RUNTIME_DEVICE=NAME" in msg
