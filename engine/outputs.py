"""What the engine hands back to callers (the offline API and the server)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One entry per token: token id -> its log-probability (top-k plus the chosen token).
LogprobsEntry = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One of the n samples of a request. `text`, `token_ids` and `logprobs` are
    cumulative; the `delta_*` fields hold only what is new since the previous
    output of this request (what a stream should send)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[LogprobsEntry] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """time.monotonic() timestamps of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine for metrics and logs (counters are cumulative)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0-1
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int  # tokens looked up
    prefix_cache_hits_total: int  # tokens found
    num_preemptions_total: int
