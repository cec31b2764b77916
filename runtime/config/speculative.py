"""`--speculative-config`: vLLM's JSON/dict form, validated."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How tokens are proposed, and how many per step.

    `ngram` (prompt lookup): find the longest suffix of the sequence, between
    `prompt_lookup_min` and `prompt_lookup_max` tokens, that occurred earlier, and propose the
    tokens that followed it. `draft_model`: a smaller model with the target's vocabulary
    (`model`, a folder or .gguf file) proposes them autoregressively.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, "
                                 f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs \"model\": the "
                             "path of a draft model with the target's vocabulary")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config \"model\" is only for method 'draft_model'")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict or its JSON text (as `--speculative-config` takes it); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object, got {value!r} "
                                 f"({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object / dict, got "
                             f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs \"method\" (one of "
                             f"{METHODS}) and \"num_speculative_tokens\"")
        return cls(**value)

    @property
    def needs_lookahead(self) -> bool:
        """A draft model writes the KV of its proposals into slots reserved past each step's
        tokens; prompt lookup keeps no KV of its own."""
        return self.method == "draft_model"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}
