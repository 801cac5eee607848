"""Turns each step's sampled tokens into `RequestDelta`s: detokenize, stop strings, n>1 fan-in.

A user request with n samples is n scheduler `Request`s ("children"); this module
keeps one `_ParentState` per user request and emits one `RequestDelta` whenever any
child produced something. Deltas carry only what is new (tokens, text, logprobs,
prompt logprobs): the engine keeps no cumulative copy of what it already sent, and
a step's output costs the same whatever the outputs' lengths.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.engine.core.request import Request, RequestStatus
from kvserve.engine.core.scheduler import FinishedRequest, StepPlan
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.outputs import (
    CompletionDelta,
    Logprob,
    LogprobsEntry,
    RequestDelta,
    RequestMetrics,
)

if TYPE_CHECKING:
    from kvserve.engine.worker.runner import RunnerOutput, TokenLogprobs


@dataclass(slots=True)
class _ChildState:
    request: Request
    detokenizer: IncrementalDetokenizer
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens_sent: int = 0
    num_tokens_seen: int = 0  # output tokens already detokenized
    pending_text: str = ""  # detokenized since the last emitted delta
    pending_logprobs: list[LogprobsEntry] | None = None


@dataclass(slots=True)
class _ParentState:
    request_id: str
    children: list[_ChildState]
    metrics: RequestMetrics
    pending_prompt_logprobs: list[LogprobsEntry | None] | None
    num_cached_tokens: int = 0
    touched: set[int] = field(default_factory=set)  # children with news this step
    embedding: bytes | None = None  # an embedding request's vector, sent once

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self._token_texts: dict[int, str] = {}  # logprob entries' decoded tokens

    def add(self, request_id: str, children: list[Request]) -> None:
        params = children[0].params
        has_logprobs = params.logprobs is not None
        states = [
            _ChildState(
                request=c,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer,
                    c.prompt_token_ids,
                    params.skip_special_tokens,
                    params.stop or [],
                    include_stop_str=params.include_stop_str_in_output,
                ),
                cumulative_logprob=0.0 if has_logprobs else None,
                pending_logprobs=[] if has_logprobs else None,
            )
            for c in children
        ]
        # position 0 has no logprob; it goes out with the first delta
        prompt_logprobs: list[LogprobsEntry | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        metrics = RequestMetrics(arrival_time=children[0].arrival_time)
        self.parents[request_id] = _ParentState(request_id, states, metrics, prompt_logprobs)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def abort(self, request_id: str) -> RequestDelta | None:
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        for child in parent.children:
            if child.finish_reason is None:
                child.finish_reason = RequestStatus.FINISHED_ABORTED.value
                parent.touched.add(child.request.sample_index)
        parent.metrics.finished_time = time.monotonic()
        return self._emit(parent)

    # ---- per step ----------------------------------------------------------
    def process(
        self, plan: StepPlan, out: RunnerOutput, finished: list[FinishedRequest], now: float
    ) -> tuple[list[RequestDelta], list[str]]:
        """Returns the deltas to deliver and the child ids that hit a stop string
        (the caller finishes those in the scheduler)."""
        finished_ids = {f.request.request_id for f in finished}
        stopped_by_string: list[str] = []
        touched: dict[str, _ParentState] = {}
        for item, token_id in zip(plan.scheduled, out.sampled_token_ids):
            req = item.request
            parent = self.parents.get(req.parent_id)
            if parent is None:
                continue
            if req.request_id in out.prompt_logprobs:
                self._add_prompt_logprobs(parent, req, out.prompt_logprobs[req.request_id])
                touched[parent.request_id] = parent
            if req.request_id in out.pooled:  # an embedding request: its vector ends it
                self._add_embedding(parent, req, out.pooled[req.request_id], now)
                touched[parent.request_id] = parent
            if token_id is None:
                continue
            child = parent.children[req.sample_index]
            if child.finish_reason is not None:
                continue
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
            step_logprobs = None  # one entry per new token: accepted drafts' (when speculating), the sampled one's
            if child.pending_logprobs is not None and req.request_id in out.logprobs:
                step_logprobs = [
                    *out.draft_logprobs.get(req.request_id, ()),
                    out.logprobs[req.request_id],
                ]
            is_done = req.request_id in finished_ids
            if self._detokenize(child, req, is_done, step_logprobs):
                stopped_by_string.append(req.request_id)
            parent.touched.add(req.sample_index)
            touched[parent.request_id] = parent
        deltas = []
        for parent in touched.values():
            if parent.finished:
                parent.metrics.finished_time = now
                del self.parents[parent.request_id]
            deltas.append(self._emit(parent))
        return deltas, stopped_by_string

    def _detokenize(
        self,
        child: _ChildState,
        req: Request,
        is_done: bool,
        step_logprobs: list[TokenLogprobs] | None,
    ) -> bool:
        """Feed the step's new tokens (one, or a speculating request's accepted drafts and its sampled
        token) to the detokenizer one at a time, with their logprobs; True when a stop string ended the
        request. Tokens after the one that completed a stop string are dropped from the request's output."""
        new = req.output_token_ids[child.num_tokens_seen :]
        for k, token_id in enumerate(new):
            if step_logprobs is not None:
                self._add_logprobs(child, step_logprobs[k])
            last = is_done and k == len(new) - 1
            # like a stop string, the EOS / stop token that ended the request adds no text
            hide = (
                last
                and req.status == RequestStatus.FINISHED_STOPPED
                and not req.params.include_stop_str_in_output
            )
            child.pending_text += child.detokenizer.update(
                [] if hide else [token_id], finished=last
            )
            child.num_tokens_seen += 1
            if last:
                child.finish_reason, child.stop_reason = req.status.value, req.stop_reason
            elif child.detokenizer.stop_reason is not None:
                req.stop_reason = child.detokenizer.stop_reason
                child.finish_reason, child.stop_reason = (
                    RequestStatus.FINISHED_STOPPED.value,
                    req.stop_reason,
                )
                del req.output_token_ids[child.num_tokens_seen :]
                del req.all_token_ids[req.num_prompt_tokens + child.num_tokens_seen :]
                return True
        return False

    @staticmethod
    def _add_embedding(parent: _ParentState, req: Request, vector: bytes, now: float) -> None:
        child = parent.children[req.sample_index]
        child.finish_reason = RequestStatus.FINISHED_STOPPED.value
        parent.embedding = vector
        parent.metrics.first_token_time = parent.metrics.last_token_time = now
        parent.touched.add(req.sample_index)

    def mark_scheduled(self, request: Request, now: float) -> None:
        parent = self.parents.get(request.parent_id)
        if parent is not None and parent.metrics.first_scheduled_time is None:
            parent.metrics.first_scheduled_time = now
            parent.num_cached_tokens = request.num_computed_tokens

    def _add_logprobs(self, child: _ChildState, lp: TokenLogprobs) -> None:
        # set together when the request asked for logprobs, the only time this is called
        assert child.pending_logprobs is not None and child.cumulative_logprob is not None
        child.pending_logprobs.append(self._entry(lp))
        child.cumulative_logprob += lp[1]

    def _add_prompt_logprobs(
        self, parent: _ParentState, req: Request, entries: list[TokenLogprobs]
    ) -> None:
        if (
            req.sample_index == 0
        ):  # the n samples share the prompt; the runner scores each position once
            assert (
                parent.pending_prompt_logprobs is not None
            )  # set when prompt logprobs were asked for
            parent.pending_prompt_logprobs.extend(self._entry(lp) for lp in entries)

    def _entry(self, lp: TokenLogprobs) -> LogprobsEntry:
        token_id, logprob, rank, top_ids, top_lps = lp
        entry = {
            tid: Logprob(tid_lp, r + 1, self._token_text(tid))
            for r, (tid, tid_lp) in enumerate(zip(top_ids, top_lps))
        }
        if token_id not in entry:
            entry[token_id] = Logprob(logprob, rank, self._token_text(token_id))
        return entry

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _emit(self, parent: _ParentState) -> RequestDelta:
        outputs = [self._take_delta(parent.children[i]) for i in sorted(parent.touched)]
        parent.touched.clear()
        embedding, parent.embedding = parent.embedding, None
        prompt_logprobs = parent.pending_prompt_logprobs
        if prompt_logprobs is not None:
            parent.pending_prompt_logprobs = []
        return RequestDelta(
            request_id=parent.request_id,
            outputs=outputs,
            finished=parent.finished,
            metrics=RequestMetrics(
                **{s: getattr(parent.metrics, s) for s in RequestMetrics.__struct_fields__}
            ),
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=prompt_logprobs or None,
            embedding=embedding,
        )

    @staticmethod
    def _take_delta(child: _ChildState) -> CompletionDelta:
        tokens = child.request.output_token_ids
        delta = CompletionDelta(
            index=child.request.sample_index,
            text=child.pending_text,
            token_ids=tokens[child.num_tokens_sent :],
            logprobs=child.pending_logprobs,
            cumulative_logprob=child.cumulative_logprob,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
        )
        child.num_tokens_sent, child.pending_text = len(tokens), ""
        if child.pending_logprobs is not None:
            child.pending_logprobs = []
        return delta
