"""What a request constrains its output to: vLLM's `StructuredOutputsParams`."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

# The most whitespace characters between two JSON tokens: room for a newline and an indent, so
# pretty-printed JSON stays legal, while a model that favours whitespace (a weak or random one)
# must go on with the value instead of padding until max_tokens. vLLM sets no bound; 8 is the
# one proposed there (vllm-project/vllm#44619).
MAX_WHITESPACE_CNT = 8

# JSON text (a schema sent as a string, a tool call's arguments) nested deeper is refused before
# any parser sees it: Python's and the grammar libraries' parsers recurse.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in the JSON `text` (0 for a scalar), without parsing it:
    brackets outside strings, counted in numpy (a megabyte takes milliseconds)."""
    chars = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8", "replace"), np.uint8)
    opens = (chars == ord("{")) | (chars == ord("["))
    closes = (chars == ord("}")) | (chars == ord("]"))
    steps = opens.astype(np.int64) - closes
    return int(np.cumsum(steps).max(initial=0))


def loads_json_text(text: str, what: str) -> object:
    """`text` parsed as JSON; ValueError naming `what` when it is not JSON or nests deeper
    than MAX_JSON_DEPTH."""
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


@dataclass
class StructuredOutputsParams:
    """Exactly one kind of constraint, validated on construction.

    `json`: a JSON schema (a dict or its JSON text); `regex`: a regular expression the whole
    output matches; `choice`: the output is one of these strings; `grammar`: an EBNF (GBNF)
    grammar whose rule `root` derives the output; `json_object`: any JSON object;
    `structural_tag`: an xgrammar structural tag (JSON text). `disable_any_whitespace` makes
    JSON output compact (no free whitespace between tokens). `_checked_by` is set by the server
    once its grammar checker (`checker.GrammarChecker`) has checked the constraint with that
    backend, so the engine does not check it again on the event loop; not by users.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    _checked_by: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            loads_json_text(self.json, "structured_outputs.json")
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
