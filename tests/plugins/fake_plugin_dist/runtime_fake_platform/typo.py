"""A plugin implementing a hook that does not exist (a typo): must be refused."""
from runtime.plugins.hookspecs import hookimpl


@hookimpl
def runtime_detect_platform():
    return []
