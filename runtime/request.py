"""A request as the scheduler sees it: tokens, how many are computed, and the blocks holding them."""
from __future__ import annotations

import enum
import time

from runtime.lora.request import LoRARequest
from runtime.multimodal.inputs import MultiModalFeature, TensorData
from runtime.pooling.params import PoolingParams
from runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    """One sequence being generated (a request with n > 1 becomes n of these), or one prompt
    being pooled (`pooling_params` set: it samples nothing and finishes with its prompt).

    There are no phases: `num_computed_tokens` says how much of `all_token_ids` has its KV in
    the cache, and each step schedules some of the rest.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, priority: int = 0, arrival_time: float | None = None,
                 parent_id: str | None = None, sample_index: int = 0,
                 leader_id: str | None = None, lora_request: LoRARequest | None = None,
                 pooling_params: PoolingParams | None = None,
                 output_token_ids: list[int] | None = None,
                 mm_features: list[MultiModalFeature] | None = None,
                 prompt_embeds: TensorData | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # a request re-admitted onto a fresh engine core arrives with what it had generated
        self.all_token_ids = list(prompt_token_ids) + list(output_token_ids or ())
        self.params = params
        self.max_tokens = max_tokens
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.parent_id = parent_id or request_id
        self.sample_index = sample_index
        self.leader_id = leader_id  # sample 0 of the same n > 1 request, whose prompt KV we share
        self.lora_request = lora_request  # the adapter it runs under (None: the base model)
        self.pooling_params = pooling_params
        # the prompt's images, in prompt order: their embeddings replace their placeholders
        self.mm_features = mm_features or []
        # a prompt given as embeddings (runtime.engine.prompt_embeds): its token ids are
        # placeholders, and the workers take these rows at the prompt's positions
        self.prompt_embeds = prompt_embeds
        self._cache_seed: bytes | None = None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first schedule
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of this request's full blocks
        self.num_indexed_blocks = 0  # leading blocks already entered in the prefix-cache index
        self.state_slot: int | None = None  # a hybrid model's recurrent state slot, while running
        # tokens proposed by speculative decoding, to verify next step (not part of the sequence)
        self.spec_token_ids: list[int] = []
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None  # when first scheduled (/metrics)
        # what the KV connector returned when it finished (for its output)
        self.finished_kv_transfer_params: dict | None = None

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request else 0

    @property
    def kv_transfer_params(self) -> dict | None:
        """What the request asks of the KV connector (vLLM's extra_args entry)."""
        return (self.params.extra_args or {}).get("kv_transfer_params")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def mm_keys(self, start: int, end: int) -> bytes:
        """The content hashes of the items whose placeholders lie in tokens [start, end):
        part of the prefix-cache key of a block there (the same text with another image
        must not hit)."""
        return b"".join(f.identifier.encode() for f in self.mm_features
                        if f.overlaps(start, end))

    def cache_seed(self) -> bytes | None:
        """What the prefix-cache hash chain starts from: the adapter's name and path (two
        adapters never share a block; not its id, which `--lora-modules` numbers by order, so
        the offload tier's disk blocks keep their adapter across a restart), and the prompt
        embeddings' digest (their placeholders say nothing)."""
        if self._cache_seed is None and (self.lora_int_id or self.prompt_embeds is not None):
            adapter = self.lora_request
            seed = f"{adapter.lora_name}\0{adapter.lora_path}\0".encode() if adapter else b""
            self._cache_seed = seed + (self.prompt_embeds.digest()
                                       if self.prompt_embeds is not None else b"")
        return self._cache_seed

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def room(self, max_model_len: int) -> int:
        """How many more tokens the request may generate."""
        return min(self.max_tokens - self.num_output_tokens, max_model_len - self.num_tokens)

    def check_stop(self, max_model_len: int) -> bool:
        """After a token was appended: set the finished status if a stop condition holds."""
        last = self.all_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens and \
                last in self.params.all_stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            # as vLLM: the stop token the request asked for, None for the model's EOS
            self.stop_reason = None if last == self.params.eos_token_id \
                and not self.params.ignore_eos else last
        elif self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
        return self.is_finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
