"""The scheduler's view of one sequence being generated (plain Python, no tensors)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Protocol

from kvserve.engine.core.kv_cache_manager import ROOT_DIGEST

if TYPE_CHECKING:
    from kvserve.engine.lora_request import LoRARequest
    from kvserve.engine.pooling_params import PoolingParams
    from kvserve.engine.sampling_params import GenerationConstraints, SamplingParams


class RequestGrammar(Protocol):
    """What the core asks of a constrained request's grammar (engine/structured_output/)."""

    is_terminated: bool

    def valid_drafts(self, tokens: list[int]) -> int: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


class Request:
    """One sequence: a prompt plus the tokens generated so far.

    A user request with `n > 1` becomes n `Request`s that share the prompt (and,
    through prefix caching, its KV blocks). Invariant: `num_computed_tokens` tokens
    of `all_token_ids` have K/V in the cache; the scheduler catches it up to
    `num_tokens` a chunk at a time, and a step that reaches the end samples a token.
    """

    __slots__ = (
        "request_id",
        "parent_id",
        "sample_index",
        "params",
        "seed",
        "eos_token_ids",
        "max_tokens",
        "prompt_token_ids",
        "all_token_ids",
        "output_token_ids",
        "num_computed_tokens",
        "status",
        "stop_reason",
        "num_preemptions",
        "arrival_time",
        "first_scheduled_time",
        "first_token_time",
        "last_token_time",
        "finished_time",
        "structured",
        "prefix_root",
        "spec_skip",
        "spec_backoff",
        "encoder_token_ids",
        "priority",
        "pooling",
        "constraints",
        "lora_request",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        max_tokens: int,
        parent_id: str | None = None,
        sample_index: int = 0,
        seed: int | None = None,
        arrival_time: float | None = None,
        prefix_root: bytes = ROOT_DIGEST,
        encoder_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        pooling: PoolingParams | None = None,
        constraints: GenerationConstraints | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.sample_index = sample_index
        self.params = params
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        # structured outputs: this sequence's grammar matcher (engine/structured_output/grammar.py), set in the core
        self.structured: RequestGrammar | None = None
        # the parent digest of its first KV block (`kv_cache_manager.prefix_root`: the cache salt and the like)
        self.prefix_root = prefix_root
        # speculative decoding's back-off (engine/spec_decode/proposer.py): steps left without drafts, and the
        # next pause after another verification that accepts nothing
        self.spec_skip = 0
        self.spec_backoff = 0  # 0: the first pause (spec_decode.FIRST_BACKOFF_STEPS)
        # encoder-decoder models: the encoder's input; `prompt_token_ids` are then the decoder's
        self.encoder_token_ids = encoder_token_ids
        self.priority = priority  # lower runs first under the priority scheduling policy
        # an embedding request (defaults resolved): a prefill that samples nothing and finishes once its
        # prompt is computed; `params` then only fills the runner's sampling row
        self.pooling = pooling
        # generation-config processors on its logits (engine/generation_logits.py); None: none
        self.constraints = constraints
        self.lora_request = lora_request  # its LoRA adapter (docs/lora.md); None = the base model

    @property
    def lora_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def schedule_key(self) -> tuple[int, float]:
        """The order of the priority policy: lower priority value first, then earlier arrival."""
        return self.priority, self.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def skips_prefix_cache(self) -> bool:
        """It needs every prompt position computed: prompt logprobs (logits), embeddings (hidden states)."""
        return self.wants_prompt_logprobs or self.pooling is not None

    @property
    def is_pooled(self) -> bool:
        """An embedding request whose whole prompt is computed: the runner has pooled it."""
        return self.pooling is not None and self.num_computed_tokens >= self.num_prompt_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
