"""How one request is sampled: vLLM's parameter names, defaults and ranges."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from runtime.config import MAX_LOGPROBS
from runtime.structured_output.params import StructuredOutputsParams

GREEDY_EPS = 1e-5  # a temperature below this means greedy decoding
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1  # seeds and token ids cross the wire as int64


@dataclass
class SamplingParams:
    """Sampling settings of one request; validated on construction.

    `top_k` 0 or -1 means no top-k filter (stored as 0). `max_tokens=None` lets the request run
    up to the model's context limit. `logprobs=k` returns the sampled token's logprob plus the
    k most likely alternatives at each step; `prompt_logprobs=k` does the same for the prompt.
    `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar.
    `logit_bias` adds a value to a token's logit ({token id: bias in [-100, 100]});
    `allowed_token_ids` restricts sampling to those tokens; `bad_words` are never generated
    (a word's last token is banned where the output ends with the word's other tokens).
    `_eos_token_id` is set by the engine through `with_eos`, `_bad_words_token_ids` (the
    tokenized `bad_words`) by the input processor, not by users. `_reasoning_token_ids` (the
    start and end markers' ids, set by the server's --reasoning-parser) holds the grammar of
    `structured_outputs` back until the reasoning has ended, as vLLM does. `extra_args` is
    vLLM's open dict; its "kv_transfer_params" go to the KV connector (docs/kv_connectors.md).
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: what a plugin or connector reads; "kv_transfer_params" for a KV connector
    extra_args: dict[str, Any] | None = None
    # An init field (not init=False) so that dataclasses.replace and clone keep it.
    _eos_token_id: int | None = dataclasses.field(default=None, repr=False)
    _bad_words_token_ids: list[list[int]] | None = dataclasses.field(default=None, repr=False)
    _reasoning_token_ids: tuple[int, int] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, 1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n, got best_of={self.best_of} and n={self.n}")
            if self.best_of > 1 and self.temperature < GREEDY_EPS:
                raise ValueError(f"best_of must be 1 with greedy sampling (temperature 0), got "
                                 f"best_of={self.best_of}: greedy samples are all the same")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1 or 0 (off) or an integer >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        # The engine seeds sample i with seed + i: within int64 that never overflows the
        # generator's 64-bit seed.
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise ValueError(f"seed must be in [{INT64_MIN}, {INT64_MAX}], got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("temperature", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], "
                                 f"got {value!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings need detokenize=True, got stop={self.stop}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must hold integers >= 0, got {t!r}")
            if t > INT64_MAX:
                raise ValueError(f"stop_token_ids must hold integers <= {INT64_MAX}, got {t}")
        for t, bias in (self.logit_bias or {}).items():
            if t < 0 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], "
                                 f"got {t}: {bias}")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0
                for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids >= 0, "
                             f"got {self.allowed_token_ids!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {self.extra_args!r}")
        if self.bad_words is not None and not all(isinstance(w, str) and w.strip()
                                                  for w in self.bad_words):
            raise ValueError(f"bad_words must hold non-empty strings, got {self.bad_words!r}")

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax instead of sampling."""
        return self.temperature < GREEDY_EPS

    @property
    def num_samples(self) -> int:
        """How many sequences are generated: best_of (the best n are returned), else n."""
        return self.best_of or self.n

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """The token ids that end the request: stop_token_ids, plus eos unless ignore_eos."""
        ids = set(self.stop_token_ids)
        if self._eos_token_id is not None and not self.ignore_eos:
            ids.add(self._eos_token_id)
        return frozenset(ids)

    def with_eos(self, eos_token_id: int | None) -> SamplingParams:
        """A copy that knows the model's end-of-sequence token."""
        return dataclasses.replace(self, _eos_token_id=eos_token_id)

    def clone(self, **changes) -> SamplingParams:
        """A copy (with its own lists), optionally with some fields changed."""
        return dataclasses.replace(self, **changes)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value > INT64_MAX:
        raise ValueError(f"{name} must be an integer <= {INT64_MAX}, got {value!r}")
