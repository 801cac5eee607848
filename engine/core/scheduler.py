"""Continuous-batching scheduler: plain Python, no tensors (a test checks that torch is not imported).

There are no prefill and decode phases. Each request has `num_computed_tokens`,
and each step tries to catch it up to `num_tokens` within a token budget:
running requests first (protecting inter-token latency), then waiting ones in
the budget that is left. A prompt longer than the budget is prefilled in chunks,
mixed with other requests' decodes in the same step.

When the KV pool runs out, the newest running request is preempted: its blocks
are freed and it goes back to the front of the waiting queue, to be recomputed
later (its generated tokens are kept; prefix caching usually gives most of the
recompute back).

Under the `priority` policy (vLLM's `--scheduling-policy priority`) both queues are kept in
`Request.schedule_key` order (lower priority value first, then earlier arrival): the head of
`waiting` is admitted first, and the last running request, the one preempted, is the lowest
priority. Under `fcfs` that order is arrival order, which appending already keeps.

Features attach through a few optional collaborators, each called only when it is on:
`proposer` (speculative decoding, engine/spec_decode/: draft tokens for decoding requests) and
`cross_cache` (encoder-decoder models, engine/seq2seq/: the encoder output's blocks). A
constrained request's grammar (engine/structured_output/) rides on `Request.structured` and ends
the request when it is complete. Without them this is plain continuous batching over the
decoder's paged cache (`KVCacheManager`, engine/core/kv_cache_manager.py).

Each `StepPlan` carries two views of the same step: `scheduled` (live `Request`s,
for the engine's output processing) and `record`, a plain-data `StepRecord` for
the runner (engine/core/step_record.py): new requests in full, known ones as deltas,
and the ids to drop.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.engine.config import SchedulerConfig
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.request import Request, RequestStatus
from kvserve.engine.core.step_record import NewRequestData, StepRecord

if TYPE_CHECKING:
    from kvserve.engine.seq2seq.cross_cache import CrossCache
    from kvserve.engine.spec_decode.proposer import Proposer


def _schedule_key(request: Request) -> tuple[int, float]:
    return request.schedule_key


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """The engine side's view of one scheduled request (the runner gets `StepPlan.record`)."""

    request: Request
    start_pos: int  # == num_computed_tokens before this step
    num_new_tokens: (
        int  # tokens to compute this step; 1 for a decode (plus its drafts when speculating)
    )
    is_sampled: bool  # this step reaches the end of the sequence: sample the next token
    spec_token_ids: tuple[
        int, ...
    ] = ()  # draft tokens verified this step (engine/spec_decode/proposer.py)

    @property
    def token_ids(self) -> list[int]:
        num_known = self.num_new_tokens - len(self.spec_token_ids)
        return self.request.all_token_ids[self.start_pos : self.start_pos + num_known] + list(
            self.spec_token_ids
        )


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: `scheduled` (live requests) for the engine's bookkeeping, `record` (plain data)
    for the runner; both list the scheduled requests in the same order."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    record: StepRecord
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    request: Request
    new_token_id: int | None  # the token sampled this step, if any


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        proposer: Proposer | None = None,
        cross_cache: CrossCache | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.proposer = proposer  # speculative decoding's drafts; None: off
        self.cross_cache = (
            cross_cache  # encoder-decoder models' encoder outputs; None: a decoder-only model
        )
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # speculative decoding: request-steps that verified drafts, the drafts, those accepted
        self.num_verifications = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # what the runner must drop, kept until a non-empty step carries it there
        self._finished_req_ids: list[str] = []
        self._preempted_req_ids: list[str] = []

    # ---- queue management --------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        if self.config.scheduling_policy == "priority":
            bisect.insort(self.waiting, request, key=_schedule_key)
        else:
            self.waiting.append(request)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request (finished or aborted) and free its blocks; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        (self.running if request.status == RequestStatus.RUNNING else self.waiting).remove(request)
        request.status = status
        self._release(request)
        self._finished_req_ids.append(request_id)
        return request

    # ---- one step ----------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        new_block_ids: dict[str, tuple[int, ...]] = {}

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts, block_ids = (
                self._speculate(request, num_new, budget)
                if self.proposer is not None
                else ((), None)
            )
            if block_ids is None:
                block_ids = self._allocate_or_preempt(request, num_new, preempted)
            if block_ids is None:
                break  # `request` itself was preempted; everything after it too
            if block_ids:
                new_block_ids[request.request_id] = tuple(block_ids)
            scheduled.append(self._plan(request, num_new, drafts))
            budget -= num_new + len(drafts)
            i += 1

        new_requests: list[NewRequestData] = []
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, new_requests)
        self._preempted_req_ids += preempted
        record = self._make_record(scheduled, new_requests, new_block_ids)
        return StepPlan(scheduled, self.config.max_num_batched_tokens - budget, record, preempted)

    def _speculate(
        self, request: Request, num_new: int, budget: int
    ) -> tuple[tuple[int, ...], list[int] | None]:
        """Speculative decoding: draft tokens for a decoding request (one new token) and the new block
        ids that hold them; ((), None) when it does not speculate, or when the blocks are not free
        (speculation never preempts anyone)."""
        if num_new != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return (), None
        assert self.proposer is not None  # called only with speculation on
        drafts = self.proposer.propose_for(request, len(self.running), budget)
        if not drafts:
            return (), None
        block_ids = self.kv_cache_manager.allocate(
            request.request_id, request.num_computed_tokens + 1 + len(drafts)
        )
        return (tuple(drafts), block_ids) if block_ids is not None else ((), None)

    def _make_record(
        self,
        scheduled: list[ScheduledRequest],
        new_requests: list[NewRequestData],
        new_block_ids: dict[str, tuple[int, ...]],
    ) -> StepRecord:
        finished: tuple[str, ...] = ()
        preempted: tuple[str, ...] = ()
        if scheduled:  # an empty step never reaches the runner: keep the drops for the next one
            finished, preempted = tuple(self._finished_req_ids), tuple(self._preempted_req_ids)
            self._finished_req_ids.clear()
            self._preempted_req_ids.clear()
        return StepRecord(
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            new_requests=tuple(new_requests),
            req_ids=tuple([it.request.request_id for it in scheduled]),
            num_computed_tokens=tuple([it.start_pos for it in scheduled]),
            num_scheduled_tokens=tuple([it.num_new_tokens for it in scheduled]),
            new_block_ids=new_block_ids,
            spec_token_ids={
                it.request.request_id: it.spec_token_ids for it in scheduled if it.spec_token_ids
            },
            block_copies=self.kv_cache_manager.take_block_copies(),
            lora_ids_in_use=self.lora_ids_in_use() if self.config.max_lora_slots else (),
        )

    def lora_ids_in_use(self) -> tuple[int, ...]:
        """The LoRA adapters of the running and waiting requests (sorted)."""
        return tuple(sorted({r.lora_id for r in (*self.running, *self.waiting)} - {0}))

    def _allocate_or_preempt(
        self, request: Request, num_new: int, preempted: list[str]
    ) -> list[int] | None:
        """The request's new block ids, or None when it had to be preempted itself."""
        num_tokens = request.num_computed_tokens + num_new
        while (block_ids := self.kv_cache_manager.allocate(request.request_id, num_tokens)) is None:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None
        return block_ids

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.scheduling_policy == "priority":
            self._enqueue(request)  # its arrival puts it ahead of later requests of its priority
        else:
            self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        """Free a finished or preempted request's blocks (its computed tokens keep a partial last block)."""
        self._free_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens)
        if self.proposer is not None:
            self.proposer.release(request.request_id)

    def _free_blocks(
        self, request_id: str, token_ids: Sequence[int] = (), num_computed_tokens: int = 0
    ) -> None:
        self.kv_cache_manager.free(request_id, token_ids, num_computed_tokens)
        if self.cross_cache is not None:
            self.cross_cache.free(request_id)

    def _admit_waiting(
        self, budget: int, scheduled: list[ScheduledRequest], new_requests: list[NewRequestData]
    ) -> int:
        kv = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self._lora_fits(request):
                break  # its adapter waits for a LoRA slot; nobody overtakes it
            # prompt logprobs and embeddings need every prompt position: no cached prefix for them
            cached_ids, partial = [], (0, 0)
            if not request.skips_prefix_cache:
                cached_ids = kv.find_cached_prefix(
                    request.request_id, request.all_token_ids, request.prefix_root
                )
                partial = kv.find_partial_block(
                    request.request_id, request.all_token_ids, len(cached_ids)
                )
            num_computed = len(cached_ids) * kv.block_size + partial[1]
            num_encoder = 0  # an encoder-decoder request's source tokens to encode this step
            if self.cross_cache is not None:
                admitted = self.cross_cache.admit(request, budget, bool(scheduled))
                if admitted is None:
                    break
                num_encoder = admitted
            num_new = min(request.num_tokens - num_computed, max(budget - num_encoder, 1))
            if kv.allocate(request.request_id, num_computed + num_new, cached_ids, partial) is None:
                self._free_blocks(request.request_id)  # its cross blocks, if it took some
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            if (
                self.config.scheduling_policy == "priority"
            ):  # the lowest priority stays last: the one preempted
                bisect.insort(self.running, request, key=_schedule_key)
            else:
                self.running.append(request)
            scheduled.append(self._plan(request, num_new))
            # new to the runner (a resumed request too: its old row was dropped with its blocks)
            cross_ids = (
                self.cross_cache.block_ids(request.request_id)
                if self.cross_cache is not None
                else ()
            )
            new_requests.append(
                NewRequestData.from_request(
                    request, kv.block_ids(request.request_id), cross_ids, encode=num_encoder > 0
                )
            )
            budget -= num_new + num_encoder
        return budget

    def _lora_fits(self, request: Request) -> bool:
        """At most `max_loras` distinct LoRA adapters run at once (the runner's slots)."""
        if not request.lora_id or not self.config.max_lora_slots:
            return True
        running = {r.lora_id for r in self.running} - {0}
        return request.lora_id in running or len(running) < self.config.max_lora_slots

    def _plan(
        self, request: Request, num_new: int, drafts: tuple[int, ...] = ()
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request=request,
            start_pos=start,
            num_new_tokens=num_new + len(drafts),
            is_sampled=start + num_new == request.num_tokens,
            spec_token_ids=drafts,
        )

    # ---- after the model ran -------------------------------------------------
    def update(
        self,
        plan: StepPlan,
        sampled_token_ids: list[int | None],
        accepted: dict[str, tuple[int, ...]] | None = None,
    ) -> list[FinishedRequest]:
        """Advance each scheduled request; append sampled tokens; finish those that stop.

        `sampled_token_ids` is aligned with `plan.scheduled` (None where nothing was sampled);
        `accepted` holds a speculating request's accepted drafts, which come before its sampled
        token. Rejected drafts are rolled back: their positions count as not computed, their K/V
        is overwritten later, and no prefix-cache entry covers them.
        Stop strings are checked later by the detokenizer, which calls `finish`.
        """
        if (
            self.cross_cache is not None
        ):  # the encoder outputs this step computed are in their blocks
            self.cross_cache.mark_written(plan.record)
        finished = []
        for item, token_id in zip(plan.scheduled, sampled_token_ids):
            request = item.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids)
            status = None
            if item.spec_token_ids:
                status, token_id = self._accept_drafts(request, item, accepted, token_id)
            # register full blocks before a finish frees them: a follow-up turn can reuse them
            self.kv_cache_manager.cache_full_blocks(
                request.request_id,
                request.all_token_ids,
                request.num_computed_tokens,
                request.prefix_root,
            )
            if token_id is None:
                if (
                    request.is_pooled
                ):  # an embedding request ends with its prompt (nothing is sampled)
                    self.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
                    finished.append(FinishedRequest(request, None))
                continue
            if status is None:
                request.append_output_token(token_id)
                status = self._check_stop(request, token_id)
            if status is not None:
                self.finish(request.request_id, status)
                finished.append(FinishedRequest(request, token_id))
        return finished

    def _accept_drafts(
        self,
        request: Request,
        item: ScheduledRequest,
        accepted: dict[str, tuple[int, ...]] | None,
        token_id: int | None,
    ) -> tuple[RequestStatus | None, int | None]:
        """Speculative decoding: append a verified request's accepted drafts, each of whose K/V is
        valid (it counts as computed) -> (the status, when a draft stopped the request, and the
        step's last token: that draft then, else the sampled `token_id`)."""
        drafts = accepted.get(request.request_id, ()) if accepted else ()
        status = None
        for draft in drafts:
            request.append_output_token(draft)
            request.num_computed_tokens += 1
            status = self._check_stop(request, draft, is_draft=True)
            if status is not None:
                token_id = draft
                break
        assert self.proposer is not None  # drafts come only with speculation on
        self.proposer.record(request, len(drafts))
        self.num_verifications += 1
        self.num_draft_tokens += len(item.spec_token_ids)
        self.num_accepted_tokens += len(drafts)
        return status, token_id

    def _check_stop(
        self, request: Request, token_id: int, is_draft: bool = False
    ) -> RequestStatus | None:
        params = request.params
        # (a draft never completes a grammar: `SequenceGrammar.valid_drafts`; the matcher has
        # already taken the step's last token too)
        if not is_draft and request.structured is not None and request.structured.is_terminated:
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None
