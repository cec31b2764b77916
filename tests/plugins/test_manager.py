"""The plugin manager with only the built-in platforms installed."""
from runtime.plugins import hookspecs
from runtime.plugins.manager import (BUILTIN_PLUGINS, discovered_plugins, get_plugin_manager,
                             reset_plugin_manager)


def test_builtins_are_registered():
    assert "runtime.platforms.cpu" in BUILTIN_PLUGINS
    records = {r.name: r for r in discovered_plugins()}
    assert records["cpu"].loaded and records["cpu"].source == "builtin"
    assert "fake" not in records  # the test plugin is only visible through its fixture
    pm = get_plugin_manager()
    assert pm.project_name == hookspecs.PROJECT
    assert pm.get_plugin("cpu").__name__ == "runtime.platforms.cpu"


def test_manager_is_cached_until_reset():
    pm = get_plugin_manager()
    assert get_plugin_manager() is pm
    reset_plugin_manager()
    assert get_plugin_manager() is not pm


def test_runtime_plugins_restricts_builtins(monkeypatch):
    monkeypatch.setenv("RUNTIME_PLUGINS", " nosuch ,")
    records = {r.name: r for r in discovered_plugins()}
    assert not records["cpu"].loaded and records["cpu"].reason == "excluded by RUNTIME_PLUGINS"
    assert records["nosuch"].source == "RUNTIME_PLUGINS" and not records["nosuch"].loaded
    assert get_plugin_manager().get_plugin("cpu") is None


def test_every_hook_spec_is_registered():
    hook = get_plugin_manager().hook
    for name in ("runtime_detect_platforms", "runtime_attention_backend", "runtime_graph_runner",
                 "runtime_communicator", "runtime_quantization_kernel", "runtime_custom_op",
                 "runtime_register_models", "runtime_register_kv_connectors"):
        assert getattr(hook, name).has_spec()
