"""The platform conformance suite: what every platform plugin must pass on its own device.

    python -m runtime.testing.conformance --device NAME [pytest options]

which is `python -m pytest -p runtime.testing.conformance.plugin --pyargs
runtime.testing.conformance --device NAME`; `RUNTIME_DEVICE=NAME python -m pytest --pyargs
runtime.testing.conformance` works too, and without either the platform detection picks is
tested. It
loads a tiny random Llama, generates with it and compares with `transformers`, checks the chosen
attention backend against float32 attention math (per step, kind of row and head, naming the
bug a mismatch matches) and each custom op as the layers run it against the portable op, and
exercises each hook the platform's plugins implement: detection, attention backend (and its
candidates), graph runner (eager and recorded runs must agree), communicator, custom ops and
quantization kernels. Hooks a platform does not implement are skipped with the reason.
"""
