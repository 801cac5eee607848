"""The sampler's inputs built from scratch out of live `Request`s: the reference.

A test helper: the runner's persistent `InputBatch` (engine/worker/input_batch.py)
keeps the same tensors current from the plain-data step records, and the tests
check it against this builder step by step. One pass over the batch gathers plain
Python values; `SamplingTensors.from_lists` normalizes them (so fast paths
trigger) and makes the tensors. Child seeds and RNG step counters come from the
scheduler's requests, not from SamplingParams, because the n samples of one
request each need their own stream.
"""

from __future__ import annotations

import torch

from kvserve.engine.core.request import Request
from kvserve.engine.worker.sampler import SamplingTensors


def _suppressed_ids(req: Request) -> list[int]:
    """EOS (unless ignored) and stop token ids may not be sampled before min_tokens outputs."""
    p = req.params
    if req.num_output_tokens >= p.min_tokens:
        return []
    return list(p.stop_token_ids or ()) + ([] if p.ignore_eos else list(req.eos_token_ids))


def build_sampling_tensors(
    requests: list[Request], vocab_size: int, device: torch.device
) -> SamplingTensors:
    params = [r.params for r in requests]
    has_penalties = any(
        p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params
    )
    return SamplingTensors.from_lists(
        vocab_size=vocab_size,
        temperature=[p.temperature for p in params],
        top_k=[p.top_k for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
        repetition_penalty=[p.repetition_penalty for p in params],
        presence_penalty=[p.presence_penalty for p in params],
        frequency_penalty=[p.frequency_penalty for p in params],
        seeds=[r.seed for r in requests],
        steps=[r.num_output_tokens for r in requests],
        prompt_token_ids=[r.prompt_token_ids for r in requests] if has_penalties else None,
        output_token_ids=[r.output_token_ids for r in requests] if has_penalties else None,
        suppressed_token_ids=[_suppressed_ids(r) for r in requests],
        max_num_logprobs=max((p.logprobs or 0 for p in params), default=0),
        needs_logprobs=any(p.logprobs is not None for p in params),
        device=device,
    )
