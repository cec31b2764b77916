"""`--structured-outputs-config`: which grammar backend the engine compiles constraints with
(runtime.structured_output.backends holds the backends themselves)."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from typing import Any

BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass
class StructuredOutputsConfig:
    """The engine's structured-output settings (vLLM's `structured_outputs_config`)."""

    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"structured_outputs_config.backend must be one of "
                             f"{', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "guidance" and importlib.util.find_spec("llguidance") is None:
            raise ValueError("the guidance backend needs llguidance: pip install llguidance")

    @classmethod
    def parse(cls, value: Any) -> StructuredOutputsConfig:
        """From None (the defaults), a dict of fields or its JSON text."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("structured_outputs_config must be an object such as "
                             f'{{"backend": "guidance"}}, got {value!r}')
        unknown = sorted(set(value) - {"backend"})
        if unknown:
            raise ValueError(f"structured_outputs_config takes backend, got {unknown}")
        return cls(**value)

    @property
    def resolved_backend(self) -> str:
        return "xgrammar" if self.backend == "auto" else self.backend
