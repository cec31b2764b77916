"""What a request constrains its output to: vLLM's `StructuredOutputsParams`."""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

# The most whitespace characters between two JSON tokens: room for a newline and an indent, so
# pretty-printed JSON stays legal, while a model that favours whitespace (a weak or random one)
# must go on with the value instead of padding until max_tokens. vLLM sets no bound; 8 is the
# one proposed there (vllm-project/vllm#44619).
MAX_WHITESPACE_CNT = 8


@dataclass
class StructuredOutputsParams:
    """Exactly one kind of constraint, validated on construction.

    `json`: a JSON schema (a dict or its JSON text); `regex`: a regular expression the whole
    output matches; `choice`: the output is one of these strings; `grammar`: an EBNF (GBNF)
    grammar whose rule `root` derives the output; `json_object`: any JSON object;
    `structural_tag`: an xgrammar structural tag (JSON text). `disable_any_whitespace` makes
    JSON output compact (no free whitespace between tokens).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its "
                             f"JSON text), got {type(self.json).__name__}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice or
                                        not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: its kind, its text, the whitespace option."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace
