"""The plugin contract: hook specs, the plugin manager and entry-point discovery."""
from runtime.plugins.hookspecs import HOOK_API_VERSION, hookimpl, hookspec

__all__ = ["HOOK_API_VERSION", "hookimpl", "hookspec"]
