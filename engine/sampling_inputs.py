"""Build the sampler's per-step tensors from the requests being sampled.

The Python work here is one pass over the batch collecting plain numbers; the
sampler then runs as batched tensor math. The fast-path flags are computed from
those Python values, so the sampler never has to inspect a tensor to branch.
"""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampler import SamplingTensors


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device, non_blocking=True)


def _min_tokens_suppressed(req: Request) -> list[int]:
    """EOS and stop token ids may not be sampled before min_tokens outputs exist."""
    p = req.params
    if req.num_output_tokens >= p.min_tokens:
        return []
    return list(req.eos_token_ids) + list(p.stop_token_ids or ())


def build_sampling_tensors(requests: list[Request], vocab_size: int, device: torch.device) -> SamplingTensors:
    params = [r.params for r in requests]
    temperature = [p.temperature for p in params]
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    rep = [p.repetition_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    seeded_rows = [i for i, r in enumerate(requests) if r.seed is not None]
    suppressed = [_min_tokens_suppressed(r) for r in requests]
    no_penalties = all(x == 1.0 for x in rep) and not any(pres) and not any(freq)

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)

    def i64(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    return SamplingTensors(
        temperature=f32(temperature),
        top_k=i64(top_k),
        top_p=f32(top_p),
        min_p=f32(min_p),
        repetition_penalty=f32(rep),
        presence_penalty=f32(pres),
        frequency_penalty=f32(freq),
        seeds=i64([r.seed if r.seed is not None else 0 for r in requests]) if seeded_rows else None,
        seeded_rows=i64(seeded_rows) if seeded_rows else None,
        steps=i64([r.num_output_tokens for r in requests]),
        prompt_token_ids=None if no_penalties else _padded([r.prompt_token_ids for r in requests], vocab_size, device),
        output_token_ids=None if no_penalties else _padded([r.output_token_ids for r in requests], vocab_size, device),
        suppressed_token_ids=_padded(suppressed, vocab_size, device) if any(suppressed) else None,
        max_num_logprobs=max((p.logprobs or 0 for p in params), default=0),
        all_greedy=all(t == 0 for t in temperature),
        all_random=all(t > 0 for t in temperature),
        no_top_k=not any(top_k),
        no_top_p=all(x >= 1.0 for x in top_p),
        no_min_p=not any(min_p),
        no_penalties=no_penalties,
    )
