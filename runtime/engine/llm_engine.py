"""The synchronous engine: input processing, the core's step loop, output processing."""
from __future__ import annotations

import itertools
import logging
import time

import torch

from plugins.selection import select_platform
from runtime.config import EngineConfig
from runtime.engine.core import EngineCore
from runtime.engine.input_processor import InputProcessor, PromptType
from runtime.engine.output_processor import OutputProcessor
from runtime.model_config import ModelConfig
from runtime.model_loader.source import ModelSource, load_config, load_tokenizer, resolve_model
from runtime.outputs import RequestOutput
from runtime.request import Request, RequestStatus
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def eos_token_ids(source: ModelSource, hf_config, tokenizer) -> list[int]:
    """The tokens that end generation, as `transformers` `generate` would use them."""
    ids = None
    if source.format == "hf":
        try:
            from transformers import GenerationConfig
            ids = GenerationConfig.from_pretrained(source.path).eos_token_id
        except OSError:
            ids = None
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = select_platform(config.device)
        self.platform.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.source = resolve_model(config.model, config.tokenizer)
        hf_config = load_config(self.source, config.trust_remote_code)
        self.tokenizer = load_tokenizer(self.source, config.trust_remote_code)
        dtype = config.dtype or self.platform.default_dtype()
        if dtype not in self.platform.supported_dtypes():
            raise ValueError(f"dtype {dtype} is not supported on {self.platform.name}; "
                             f"supported: {self.platform.supported_dtypes()}")
        self.model_config = ModelConfig.from_hf(hf_config, dtype, config.max_model_len)
        logger.info("platform %s, model %s, dtype %s", self.platform.name, self.source.path,
                    str(dtype).replace("torch.", ""))
        self.core = EngineCore(config, self.platform, self.source, self.model_config)
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size,
                                     self.model_config.max_model_len,
                                     eos_token_ids(self.source, hf_config, self.tokenizer))
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Validate and queue one prompt; raises ValueError (queuing nothing) on bad input."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.inputs.tokenize(prompt)
        params = self.inputs.validate(token_ids, params)
        max_tokens = self.inputs.max_tokens(token_ids, params)
        arrival = time.monotonic()
        sample_ids = [request_id] if params.n == 1 else \
            [f"{request_id}#{k}" for k in range(params.n)]
        self.outputs.add_request(request_id, text, token_ids, params, sample_ids, arrival)
        for k, sample_id in enumerate(sample_ids):
            self.core.add_request(Request(
                sample_id, token_ids, params, max_tokens, priority, arrival,
                parent_id=request_id, sample_index=k,
                leader_id=sample_ids[0] if k else None))
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.outputs.requests.get(request_id)
        if state is None:
            return None
        for sample_id in state.samples:
            self.core.finish_request(sample_id, RequestStatus.FINISHED_ABORTED)
        return self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        results, stopped = self.outputs.process(self.core.step())
        for sample_id, stop_string in stopped:
            self.core.finish_request(sample_id, RequestStatus.FINISHED_STOPPED, stop_string)
        return results
