"""The synchronous engine: request processing around an in-process engine core."""
from __future__ import annotations

import logging

import torch

from runtime.plugins.selection import select_platform
from runtime.config import EngineConfig
from runtime.engine.core import EngineCore
from runtime.engine.input_processor import PromptType
from runtime.engine.processor import Processor
from runtime.lora.request import LoRARequest
from runtime.model_spec import ModelSpec
from runtime.outputs import RequestOutput
from runtime.request import RequestStatus
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def build_core(config: EngineConfig, spec: ModelSpec) -> EngineCore:
    """Select the platform, load the model and allocate its KV cache (in this process)."""
    platform = select_platform(config.device)
    torch.manual_seed(config.seed)
    model_config = spec.on(platform)
    logger.info("platform %s, model %s, dtype %s", platform.name, spec.source.path,
                str(model_config.dtype).replace("torch.", ""))
    return EngineCore(config, platform, spec.source, model_config)


class LLMEngine:
    """`spec`: the model `config` names, when the caller has resolved it already."""

    def __init__(self, config: EngineConfig, spec: ModelSpec | None = None) -> None:
        self.config = config
        self.spec = spec or ModelSpec.resolve(config)
        self.source = self.spec.source
        self.core = build_core(config, self.spec)
        self.model_config = self.core.model_config
        self.processor = Processor(config, self.source, self.spec.hf_config,
                                   self.model_config.max_model_len)
        self.tokenizer = self.processor.tokenizer
        self.inputs = self.processor.inputs
        self.outputs = self.processor.outputs

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> str:
        """Validate and queue one prompt; raises ValueError (queuing nothing) on bad input."""
        requests = self.processor.add_request(prompt, params, request_id, priority,
                                              lora_request=lora_request)
        for request in requests:
            self.core.add_request(request)
        return requests[0].parent_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        sample_ids, output = self.processor.abort_request(request_id)
        for sample_id in sample_ids:
            self.core.finish_request(sample_id, RequestStatus.FINISHED_ABORTED)
        return output

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        results, stopped = self.processor.process_outputs(self.core.step())
        for sample_id, stop_string in stopped:
            self.core.finish_request(sample_id, RequestStatus.FINISHED_STOPPED, stop_string)
        return results
