"""Progress bars a person watches: generation (prompts done, input and output tokens/s) and
model loading (weights read). They draw only when stderr is a terminal (tqdm's `disable=None`),
so logs and pipes stay clean."""
from __future__ import annotations

import time
from typing import Any, Iterable

from tqdm import tqdm

REFRESH_S = 0.1


def progress_bar(items: Iterable | None = None, desc: str = "", unit: str = "it",
                 total: int | None = None, enabled: bool = True, leave: bool = False) -> tqdm:
    """A tqdm bar on stderr, over `items` or counting to `total`, that draws on a terminal only
    (and never when `enabled` is False); `leave` keeps the finished bar on screen."""
    return tqdm(items, total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=leave,
                disable=None if enabled else True)


class GenerateProgress:
    """vLLM's `generate` bar: prompts processed, with the input and output speed so far.

    `update` takes each step's output of a request (cumulative outputs); the speeds count every
    prompt token once and every generated token, of finished and running requests alike."""

    def __init__(self, num_prompts: int, enabled: bool = True) -> None:
        self.bar = progress_bar(desc="Processed prompts", total=num_prompts, enabled=enabled,
                                leave=True)
        self.start = time.perf_counter()
        self.last_refresh = 0.0
        self.prompt_tokens: dict[str, int] = {}
        self.output_tokens: dict[str, int] = {}

    def update(self, output: Any) -> None:
        rid = output.request_id
        self.prompt_tokens[rid] = len(output.prompt_token_ids or ())
        self.output_tokens[rid] = sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"est. speed input: {sum(self.prompt_tokens.values()) / elapsed:.2f} toks/s, "
            f"output: {sum(self.output_tokens.values()) / elapsed:.2f} toks/s", refresh=False)
        if output.finished:
            self.bar.update(1)
        elif elapsed - self.last_refresh > REFRESH_S:
            self.bar.refresh()
            self.last_refresh = elapsed

    def __enter__(self) -> "GenerateProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()
