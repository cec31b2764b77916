"""Built-in platform plugins, one package per device family: cpu, cuda, rocm, xpu, tpu.

Each package is an ordinary pluggy plugin whose `__init__` implements one hook, detection; the
plugin manager registers it by module name (`runtime.plugins.manager.BUILTIN_PLUGINS`). What a
platform answers (attention candidates, graph runner, communicator, kernels, custom ops) is a
method of its `Platform` subclass in `platform.py`. A platform package imports the contract
(`runtime.plugins`), `runtime.attention_backends`, `runtime.quantization` and other platforms,
never the engine (`tests/plugins/test_import_graph.py` checks it).
"""
