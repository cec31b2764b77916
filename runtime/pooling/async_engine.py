"""The pooling engine behind the server: the same face as `AsyncLLM` where the server's shared
routes and lifetime touch it (start, shutdown, health, tokenizer, limits), with the forward
passes on one thread of their own, so that requests run one step at a time off the event loop."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, TypeVar

from runtime.config import EngineConfig
from runtime.model_loader.source import ModelSource
from runtime.pooling.engine import PoolingEngine, pooling_model

T = TypeVar("T")


class AsyncPoolingEngine:
    pooling = True  # the generating routes refuse this engine's model
    num_blocks = 0  # pooling requests keep no KV

    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any) -> None:
        self.config, self.source, self.hf_config = config, source, hf_config
        self.engine: PoolingEngine | None = None
        self.dead_reason: str | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pooling")

    async def start(self) -> None:
        """Load the model (after the server has bound its port)."""
        self.engine = await self.run(PoolingEngine, self.config, self.source, self.hf_config)

    async def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor,
                                                                partial(fn, *args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self.engine is not None

    async def wait_fatal(self) -> str:
        """A pooling engine runs in the server's process: it never dies apart from it."""
        await asyncio.Event().wait()
        return ""

    def fail_all(self, reason: str) -> None:
        """Nothing streams from a pooling engine: in-flight requests end with their step."""


def open_async_pooling_engine(config: EngineConfig) -> AsyncPoolingEngine | None:
    """The server's engine when the model pools (`--runner`, or auto-detected); None for a
    generation model."""
    found = pooling_model(config)
    return AsyncPoolingEngine(config, *found) if found else None
