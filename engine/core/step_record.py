"""The scheduler -> runner contract: one plain-data `StepRecord` per step (no torch, no live objects).

Everything here is ints, floats, strs, tuples and dicts of those, in `msgspec.Struct`s: the
same record carries each step to the tensor-parallel workers as a MessagePack frame
(engine/messages.py, engine/worker/tp_worker.py). It carries deltas, not histories:

- a request new to the runner (first scheduled, or resumed after a preemption)
  comes once as `NewRequestData`: its tokens so far, block table and sampling inputs;
- a request the runner already holds comes as its id, `num_computed_tokens`, the
  number of tokens scheduled and, when it got some, its new block ids;
- ids finished, aborted or preempted since the last record, so the runner drops them.

Which token ids can the runner not know? Only a prompt, and after a preemption the
outputs generated before it (both travel in `NewRequestData`). Every other token was
sampled by the runner itself, which appends it to its own copy of the sequence;
a chunked prefill only advances `num_computed_tokens` over tokens it already has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvserve.engine.sampling_params import GenerationConstraints

if TYPE_CHECKING:
    import numpy as np

    from kvserve.engine.core.request import Request


class _Record(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A field of the step's record: on the wire, an array of its fields in order."""


class SamplingInputs(_Record, frozen=True, gc=False):
    """One sequence's sampling settings as plain numbers, sent once when it joins the runner."""

    temperature: float
    top_k: int  # 0 or -1 = off
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None  # this sequence's own stream (the n samples of a request differ)
    min_tokens: int
    suppressed_token_ids: tuple[
        int, ...
    ]  # EOS (unless ignored) and stop ids, banned before min_tokens
    num_logprobs: int | None  # top-k logprobs per sampled token; None = no logprobs at all
    num_prompt_logprobs: int | None  # None = no prompt logprobs
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to this row's logits
    # generation-config processors (engine/generation_logits.py), with what they need to know
    constraints: GenerationConstraints | None = None
    max_tokens: int = 0  # forced EOS comes as the max_tokens-th output
    eos_token_ids: tuple[int, ...] = ()  # banned below min_length

    @classmethod
    def from_request(cls, request: Request) -> SamplingInputs:
        p, constrained = request.params, request.constraints
        # a constrained sequence ends when its grammar says so (suppressing EOS could leave no token)
        suppressed = (
            ()
            if p.min_tokens == 0 or p.structured_outputs is not None
            else (*(p.stop_token_ids or ()), *(() if p.ignore_eos else request.eos_token_ids))
        )
        return cls(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            seed=request.seed,
            min_tokens=p.min_tokens,
            suppressed_token_ids=tuple(suppressed),
            num_logprobs=p.logprobs,
            num_prompt_logprobs=p.prompt_logprobs,
            logit_bias=tuple(sorted((p.logit_bias or {}).items())),
            constraints=constrained,
            max_tokens=request.max_tokens if constrained is not None else 0,
            eos_token_ids=tuple(request.eos_token_ids) if constrained is not None else (),
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


class PoolingInputs(_Record, frozen=True, gc=False):
    """An embedding request's pooling, sent once when it joins the runner (engine/pooling_params.py)."""

    pooling_type: str  # "last" | "mean"
    normalize: bool
    dimensions: int | None  # keep the first N (Matryoshka); None: all

    @classmethod
    def from_request(cls, request: Request) -> PoolingInputs | None:
        p = request.pooling
        if p is None:
            return None
        # resolved against the checkpoint's defaults when the request was made
        assert p.pooling_type is not None and p.normalize is not None
        return cls(pooling_type=p.pooling_type, normalize=p.normalize, dimensions=p.dimensions)


class NewRequestData(_Record, frozen=True):
    """A sequence the runner does not hold: first scheduled, or resumed after a preemption."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # generated before a preemption; () on the first schedule
    block_ids: tuple[int, ...]  # the whole block table (a cached prefix included)
    sampling: SamplingInputs
    # encoder-decoder models: the cross blocks holding the encoder output of `cross_len` source tokens,
    # and the source itself when this step must encode it (else another request's encoding is there)
    cross_block_ids: tuple[int, ...] = ()
    cross_len: int = 0
    encoder_token_ids: tuple[int, ...] = ()
    pooling: PoolingInputs | None = None  # an embedding request: pool its prompt, sample nothing
    # its LoRA adapter (engine/lora_request.py): id (0 = the base model), name and directory
    lora_id: int = 0
    lora_name: str = ""
    lora_path: str = ""

    @classmethod
    def from_request(
        cls,
        request: Request,
        block_ids: Sequence[int],
        cross_block_ids: Sequence[int] = (),
        encode: bool = False,
    ) -> NewRequestData:
        lora = request.lora_request
        return cls(
            req_id=request.request_id,
            prompt_token_ids=tuple(request.prompt_token_ids),
            output_token_ids=tuple(request.output_token_ids),
            block_ids=tuple(block_ids),
            sampling=SamplingInputs.from_request(request),
            cross_block_ids=tuple(cross_block_ids),
            cross_len=len(request.encoder_token_ids),
            encoder_token_ids=tuple(request.encoder_token_ids) if encode else (),
            pooling=PoolingInputs.from_request(request),
            lora_id=request.lora_id,
            lora_name=lora.lora_name if lora else "",
            lora_path=lora.lora_path if lora else "",
        )


@dataclass(frozen=True, slots=True)
class GrammarBitmask:
    """The allowed tokens of this step's constrained rows, filled by engine/structured_output/grammar.py
    while the step runs (rank 0 only: it samples); rows not listed are left unfilled and never read."""

    rows: tuple[
        int, ...
    ]  # [R] indices into StepRecord.req_ids (expanded: into the step's logits rows)
    bitmask: np.ndarray  # [B, ceil(V/32)] int32: bit j of word w allows token 32 * w + j
    # a speculative step's: one row per logits row (1 + its drafts per request), not per request
    expanded: bool = False


class StepRecord(_Record, frozen=True):
    """What the runner needs for one step. Apply in field order: drop, add, then run.

    `req_ids` is the order of `StepPlan.scheduled` (the runner's outputs follow it);
    a request's step samples a token when it reaches the end of its sequence.
    """

    finished_req_ids: tuple[str, ...]  # finished or aborted since the last record: forget them
    preempted_req_ids: tuple[
        str, ...
    ]  # preempted since the last record: drop their rows (blocks are gone)
    new_requests: tuple[NewRequestData, ...]
    req_ids: tuple[str, ...]  # [B] scheduled this step, new ones included
    num_computed_tokens: tuple[int, ...]  # [B] tokens with K/V in the cache before this step
    num_scheduled_tokens: tuple[int, ...]  # [B] tokens to compute this step
    new_block_ids: dict[str, tuple[int, ...]]  # held requests that got blocks: ids to append
    # speculative decoding: a request's draft tokens, scheduled after its last token (the runner
    # verifies them and reports the accepted ones); they are not the request's tokens until accepted
    spec_token_ids: dict[str, tuple[int, ...]] = {}
    # copy-on-write of kept partly filled blocks (engine/core/kv_cache_manager.py): (source block, destination
    # block, slots), copied in every layer's cache before anything else of the step writes
    block_copies: tuple[tuple[int, int, int], ...] = ()
    # LoRA engines: the adapters of every unfinished request (running or waiting), which the
    # runner keeps read in host memory past max_cpu_loras
    lora_ids_in_use: tuple[int, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)
