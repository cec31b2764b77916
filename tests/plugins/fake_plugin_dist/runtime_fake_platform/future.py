"""A plugin written for a hook API this runtime does not provide: must be refused."""
from runtime.plugins.hookspecs import hookimpl

RUNTIME_HOOK_API_VERSION = 999


@hookimpl
def runtime_register_models():
    return {"FutureForCausalLM": "runtime_fake_platform:FakeModel"}
