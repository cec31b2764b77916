"""Built-in platform plugins, one package per device family (cpu today; cuda, rocm, xpu, tpu).

Each package is an ordinary pluggy plugin: its `__init__` holds the `@hookimpl` functions, the
plugin manager registers it by module name (`runtime.plugins.manager.BUILTIN_PLUGINS`), and it answers
only for its own device, returning None for any other platform. A platform package may import
`plugins`, `attention_backends` and `quantization`, never `runtime`.
"""
