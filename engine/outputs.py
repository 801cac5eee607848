"""What the engine hands back to callers (the offline API and the server)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class _Record(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What the engine core sends each step (engine/messages.py): a MessagePack array of its fields."""


class Logprob(_Record, gc=False):
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


class RequestMetrics(_Record, gc=False):
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
    embedding: bytes | None = None  # an embedding request's vector: little-endian float32


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # float32 values (L2-normalized unless the request said otherwise)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt (vLLM's shape: `out.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


class EngineStats(_Record, frozen=True, gc=False):  # type: ignore[misc]  # msgspec allows a frozen subclass
    """A snapshot of the engine for metrics and logs (counters are cumulative)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0-1
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    prompt_tokens_total: int  # every prompt token, once per request (cached ones included)
    generation_tokens_total: int
    prefix_cache_queries_total: int  # tokens looked up
    prefix_cache_hits_total: int  # tokens found
    num_preemptions_total: int
    # structured outputs (engine/structured_output/grammar.py)
    num_compiling: int = 0  # requests waiting for their grammar (in neither count above)
    structured_requests_total: int = 0
    grammar_compiles_total: int = 0  # cache misses
    grammar_compile_seconds_total: float = 0.0
    prompt_tokens_cached_total: int = 0  # of prompt_tokens_total, found in the prefix cache
    prompt_tokens_computed_total: int = (
        0  # run through the model, recomputation after preemption included
    )
    # distinct grammars queued or compiling, including those whose requests left (still using the CPU)
    num_grammars_compiling: int = 0
    # speculative decoding: request-steps that verified drafts, the drafts, and those accepted
    spec_verifications_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0


# ---- what the engine core emits each step: deltas only, plain data ----


class CompletionDelta(_Record):
    """What one of the n samples produced since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobsEntry] | None  # one entry per token in `token_ids` (None: not asked)
    cumulative_logprob: float | None  # the running total, not a delta
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestDelta(_Record):
    """One step's news for one user request; the engine core sends these across processes.

    `outputs` holds only the samples that changed. Nothing cumulative is repeated, so a
    message's size does not grow with the output length.
    """

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[LogprobsEntry | None] | None = None  # new prompt positions only
    embedding: bytes | None = (
        None  # an embedding request's vector (little-endian float32), in its last delta
    )


class RequestOutputBuilder:
    """Folds a request's `RequestDelta`s into `RequestOutput`s (cumulative fields plus deltas).

    `add` is O(size of the delta); `output()` copies the cumulative lists once, so a consumer
    that reads rarely pays once for everything it missed (its deltas are coalesced) and
    unread output never piles up as repeated snapshots.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        n: int,
        has_logprobs: bool,
        has_prompt_logprobs: bool,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.completions = [
            CompletionOutput(
                index=i,
                logprobs=[] if has_logprobs else None,
                delta_logprobs=[] if has_logprobs else None,
            )
            for i in range(n)
        ]
        self.prompt_logprobs: list[LogprobsEntry | None] | None = (
            [] if has_prompt_logprobs else None
        )
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.embedding: bytes | None = None
        self.finished = False
        self.has_news = False

    def add(self, delta: RequestDelta) -> None:
        for d in delta.outputs:
            c = self.completions[d.index]
            c.delta_text += d.text
            c.delta_token_ids.extend(d.token_ids)
            if d.logprobs is not None and c.delta_logprobs is not None:
                c.delta_logprobs.extend(d.logprobs)
            c.cumulative_logprob = d.cumulative_logprob
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        if delta.prompt_logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(delta.prompt_logprobs)
        self.metrics = delta.metrics
        self.num_cached_tokens = delta.num_cached_tokens
        self.embedding = delta.embedding if delta.embedding is not None else self.embedding
        self.finished = self.finished or delta.finished
        self.has_news = True

    def output(self) -> RequestOutput:
        """A `RequestOutput` that later deltas never mutate; its delta fields are what arrived
        since the previous call."""
        outputs = []
        for c in self.completions:
            c.text += c.delta_text
            c.token_ids.extend(c.delta_token_ids)
            if c.logprobs is not None and c.delta_logprobs is not None:  # set together
                c.logprobs.extend(c.delta_logprobs)
            outputs.append(
                CompletionOutput(
                    index=c.index,
                    text=c.text,
                    token_ids=list(c.token_ids),
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=list(c.logprobs) if c.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    delta_text=c.delta_text,
                    delta_token_ids=c.delta_token_ids,
                    delta_logprobs=c.delta_logprobs,
                )
            )
            c.delta_text, c.delta_token_ids = "", []
            c.delta_logprobs = [] if c.logprobs is not None else None
        self.has_news = False
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=list(self.prompt_logprobs)
            if self.prompt_logprobs is not None
            else None,
            metrics=RequestMetrics(
                **{s: getattr(self.metrics, s) for s in RequestMetrics.__struct_fields__}
            ),
            num_cached_tokens=self.num_cached_tokens,
            embedding=self.embedding,
        )
