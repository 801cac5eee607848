"""Batched sampling on the device: one call per step, no host sync, no per-request loop.

Processing order for logits [B, V] (each stage is skipped via host-side flags
when no row in the batch needs it):

1. `raw = logits.float()` (bf16/fp16 converted once). Returned logprobs, ranks
   and top-k logprobs come from log_softmax(raw): the model's own distribution.
2. suppressed tokens -> -inf (EOS / stop ids while output < min_tokens).
3. penalties: repetition (HF/vLLM: for tokens in prompt or output, logit > 0 ->
   logit / p, else logit * p), then frequency (- f * count in output), then
   presence (- p if the token occurs in the output).
4. greedy rows (temperature < 1e-5) take argmax here, of the penalized logits.
5. temperature, then top-k, then top-p (on the top-k-renormalized distribution),
   then min-p (relative to the most likely token). Only top-p sorts, and only the
   [B, max_top_k] candidates when every top-p row also has a top_k; greedy and
   top-k-only batches never sort the vocabulary.
6. exponential race: argmax(probs / q), q ~ Exp(1). Unseeded rows draw q from
   the global torch generator; seeded rows use a counter-based hash of
   (seed, step, token index), so their tokens depend neither on the batch
   they are in nor on other seeded requests.
Greedy and random rows are merged with `torch.where`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvserve.engine.sampling_params import GREEDY_TEMPERATURE_EPS
from kvserve.models import cpu_ops


@dataclass
class SamplingTensors:
    """Per-step sampling metadata; built once per step by the runner (see `from_lists`).

    Token-id matrices are padded with `vocab_size` (an index one past the
    vocabulary), so padding lands in a scratch column that is dropped.
    The boolean flags and `max_top_k` are host values computed from Python
    lists, never read back from tensors.
    """

    temperature: Tensor  # [B] float32, 0 = greedy
    top_k: Tensor  # [B] int64, 0 = off
    top_p: Tensor  # [B] float32, 1 = off
    min_p: Tensor  # [B] float32, 0 = off
    repetition_penalty: Tensor  # [B] float32
    presence_penalty: Tensor  # [B] float32
    frequency_penalty: Tensor  # [B] float32
    seeds: Tensor | None  # [B] int64, read only at seeded_rows
    seeded_rows: Tensor | None  # [S] int64 row indices of random rows with a seed
    steps: Tensor  # [B] int64 tokens generated so far (seeded stream position)
    prompt_token_ids: Tensor | None  # [B, Lp] int64 (from_lists), None when no_penalties
    output_token_ids: Tensor | None  # [B, Lo] int64 (from_lists), None when no_penalties
    suppressed_token_ids: Tensor | None  # [B, Ls] int64, None when nothing is suppressed
    max_num_logprobs: int  # K of the returned top-k logprobs, 0 = none
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_penalties: bool
    max_top_k: int | None = None  # largest active top_k (host); None = unknown, use V
    needs_logprobs: bool = True  # False: no row asked for logprobs, skip computing them
    top_p_rows_have_top_k: bool = (
        False  # every row with top_p < 1 has a top_k: top-p sorts [B, max_top_k]
    )
    # penalty state kept on the device by the runner's InputBatch (used instead of the id lists)
    prompt_mask: Tensor | None = None  # [B, V] bool, token occurs in the prompt
    output_counts: Tensor | None = None  # [B, V] float32, occurrences in the output
    # [B] float32 added to the returned logprobs: the generation config's processed scores
    # (engine/generation_logits.py); None = nothing to add
    logprob_shift: Tensor | None = None

    @classmethod
    def from_lists(
        cls,
        *,
        vocab_size: int,
        temperature: Sequence[float],
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        min_p: Sequence[float] | None = None,
        repetition_penalty: Sequence[float] | None = None,
        presence_penalty: Sequence[float] | None = None,
        frequency_penalty: Sequence[float] | None = None,
        seeds: Sequence[int | None] | None = None,
        steps: Sequence[int] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        suppressed_token_ids: Sequence[Sequence[int]] | None = None,
        max_num_logprobs: int = 0,
        needs_logprobs: bool = True,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Build from per-request Python values (None = the neutral default for every row).

        Settings that cannot matter are normalized away so that fast paths
        trigger: greedy rows get no top-k/top-p/min-p/seed, and top_k -1 or
        >= vocab_size becomes 0.
        """
        num_reqs = len(temperature)
        greedy = [t < GREEDY_TEMPERATURE_EPS for t in temperature]
        top_k = _per_row(top_k, 0, num_reqs)
        top_k = [0 if g or k < 0 or k >= vocab_size else k for g, k in zip(greedy, top_k)]
        top_p = [1.0 if g else p for g, p in zip(greedy, _per_row(top_p, 1.0, num_reqs))]
        min_p = [0.0 if g else p for g, p in zip(greedy, _per_row(min_p, 0.0, num_reqs))]
        rep = _per_row(repetition_penalty, 1.0, num_reqs)
        pres = _per_row(presence_penalty, 0.0, num_reqs)
        freq = _per_row(frequency_penalty, 0.0, num_reqs)
        no_penalties = all(r == 1.0 for r in rep) and not any(pres) and not any(freq)
        seeds = _per_row(seeds, None, num_reqs)
        seeded = [i for i, s in enumerate(seeds) if s is not None and not greedy[i]]
        has_suppressed = suppressed_token_ids is not None and any(suppressed_token_ids)

        def f32(values: Sequence[float]) -> Tensor:
            return _to_device(np.asarray(values, dtype=np.float32), device)

        def i64(values: Sequence[int]) -> Tensor:
            return _to_device(np.asarray(values, dtype=np.int64), device)

        return cls(
            temperature=f32(temperature),
            top_k=i64(top_k),
            top_p=f32(top_p),
            min_p=f32(min_p),
            repetition_penalty=f32(rep),
            presence_penalty=f32(pres),
            frequency_penalty=f32(freq),
            seeds=i64([_to_int64(s or 0) for s in seeds]) if seeded else None,
            seeded_rows=i64(seeded) if seeded else None,
            steps=i64(_per_row(steps, 0, num_reqs)),
            prompt_token_ids=None
            if no_penalties
            else _pad(prompt_token_ids or [[]] * num_reqs, vocab_size, device),
            output_token_ids=None
            if no_penalties
            else _pad(output_token_ids or [[]] * num_reqs, vocab_size, device),
            suppressed_token_ids=_pad(suppressed_token_ids or (), vocab_size, device)
            if has_suppressed
            else None,
            max_num_logprobs=max_num_logprobs,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_k=not any(top_k),
            no_top_p=all(p >= 1.0 for p in top_p),
            no_min_p=not any(min_p),
            no_penalties=no_penalties,
            max_top_k=max(top_k) if any(top_k) else None,
            needs_logprobs=needs_logprobs or max_num_logprobs > 0,
            top_p_rows_have_top_k=all(k > 0 for k, p in zip(top_k, top_p) if p < 1.0),
        )


@dataclass
class SamplerOutput:
    """Sampled tokens plus their logprobs under the model's raw distribution."""

    sampled_token_ids: Tensor  # [B] int64
    sampled_logprobs: Tensor | None  # [B] float32, log_softmax(raw logits) at the sampled token
    sampled_ranks: Tensor | None  # [B] int64, 1 + number of tokens strictly more likely
    # (the two above and the top-k are None when `SamplingTensors.needs_logprobs` is False)
    topk_token_ids: Tensor | None  # [B, K] int64, K = max_num_logprobs, best first
    topk_logprobs: Tensor | None  # [B, K] float32


class Sampler:
    """Stateless; `sampler(logits, tensors)` samples one token per row without a host sync."""

    @torch.inference_mode()
    def __call__(self, logits: Tensor, t: SamplingTensors) -> SamplerOutput:
        plain = t.suppressed_token_ids is None and t.no_penalties
        if t.all_greedy and plain and not t.needs_logprobs:
            # argmax needs no float copy: bf16 -> fp32 is exact and order-preserving
            return SamplerOutput(cpu_ops.greedy_argmax(logits), None, None, None, None)
        if t.all_greedy and plain:  # with logprobs (beam search asks for them every step)
            # the raw logits' argmax: no token is strictly more likely, so every rank is 1 (one
            # pass over [B, V] fewer than counting)
            return _logprob_output(
                logits,
                cpu_ops.greedy_argmax(logits),
                t.max_num_logprobs,
                ranks_are_1=True,
                shift=t.logprob_shift,
            )
        raw = logits.float()  # [B, V]; may alias `logits`, never written to
        x = raw
        if t.suppressed_token_ids is not None or not t.no_penalties:
            x = raw.clone()
            if t.suppressed_token_ids is not None:
                apply_suppression(x, t.suppressed_token_ids)
            if not t.no_penalties:
                if t.output_counts is not None and t.prompt_mask is not None:  # set together
                    prompt_mask, output_counts = t.prompt_mask, t.output_counts
                else:
                    prompt_mask, output_counts = penalty_state(
                        t.prompt_token_ids, t.output_token_ids, x.shape[0], x.shape[1], x.device
                    )
                x = apply_penalty_state(
                    x,
                    prompt_mask,
                    output_counts,
                    t.repetition_penalty,
                    t.presence_penalty,
                    t.frequency_penalty,
                )
        if t.all_greedy:
            token_ids = x.argmax(dim=-1)
        else:
            token_ids = _sample_random(x, t)
            if not t.all_random:
                is_greedy = t.temperature < GREEDY_TEMPERATURE_EPS
                token_ids = torch.where(is_greedy, x.argmax(dim=-1), token_ids)
        if not t.needs_logprobs:
            return SamplerOutput(token_ids, None, None, None, None)
        return _logprob_output(raw, token_ids, t.max_num_logprobs, shift=t.logprob_shift)


def apply_suppression(logits: Tensor, token_ids: Tensor) -> Tensor:
    """In place: logits[b, token_ids[b, j]] = -inf; pad id V is ignored. [B, V], [B, L]."""
    num_reqs, vocab_size = logits.shape
    mask = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, token_ids, True)
    return logits.masked_fill_(mask[:, :vocab_size], float("-inf"))


def apply_penalties(
    logits: Tensor,  # [B, V] float32
    prompt_token_ids: Tensor | None,  # [B, Lp] int64 padded with V
    output_token_ids: Tensor | None,  # [B, Lo] int64 padded with V
    repetition_penalty: Tensor,  # [B]
    presence_penalty: Tensor,  # [B]
    frequency_penalty: Tensor,  # [B]
) -> Tensor:
    """Repetition, then frequency, then presence penalty (vLLM's order). Returns new logits."""
    num_reqs, vocab_size = logits.shape
    prompt_mask, output_counts = penalty_state(
        prompt_token_ids, output_token_ids, num_reqs, vocab_size, logits.device
    )
    return apply_penalty_state(
        logits, prompt_mask, output_counts, repetition_penalty, presence_penalty, frequency_penalty
    )


def penalty_state(
    prompt_token_ids: Tensor | None,
    output_token_ids: Tensor | None,
    num_reqs: int,
    vocab_size: int,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Padded id lists -> (prompt_mask [B, V] bool, output_counts [B, V] float32), from scratch."""
    counts = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.float32, device=device)
    if output_token_ids is not None:
        counts.scatter_add_(
            1, output_token_ids, torch.ones_like(output_token_ids, dtype=counts.dtype)
        )
    seen = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.bool, device=device)
    if prompt_token_ids is not None:
        seen.scatter_(1, prompt_token_ids, True)
    return seen[:, :vocab_size], counts[:, :vocab_size]


def apply_penalty_state(
    logits: Tensor,  # [B, V] float32
    prompt_mask: Tensor,  # [B, V] bool
    output_counts: Tensor,  # [B, V] float32
    repetition_penalty: Tensor,  # [B]
    presence_penalty: Tensor,  # [B]
    frequency_penalty: Tensor,  # [B]
) -> Tensor:
    """`apply_penalties` on counts kept by the caller (rows with neutral settings are unchanged
    whatever their counts hold, as long as those are finite). Returns new logits."""
    in_output = output_counts > 0
    seen = prompt_mask | in_output
    penalty = torch.where(seen, repetition_penalty[:, None], 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits -= frequency_penalty[:, None] * output_counts
    logits -= presence_penalty[:, None] * in_output
    return logits


def apply_top_k_top_p(
    logits: Tensor,
    top_k: Tensor | None,
    top_p: Tensor | None,
    max_top_k: int | None = None,
    top_p_rows_have_top_k: bool = False,
) -> Tensor:
    """In place: keep each row's top_k logits (0 = all), then the smallest set of the
    most likely remaining tokens whose probability reaches top_p (1 = all).

    Top-k alone uses `torch.topk(max_top_k)` for a threshold and keeps every tie at
    the k-th value. With top-p, the tokens are ordered by logit, ties by token id (a
    stable sort), and top-k keeps the first k of that order. That order is found by
    sorting the whole vocabulary, or, when the host knows that every row with
    top_p < 1 also has a top_k (`top_p_rows_have_top_k`) and passes `max_top_k`,
    by sorting only [B, max_top_k] candidates; both give the same tokens.
    """
    vocab_size = logits.shape[1]
    if top_k is None and top_p is None:
        return logits
    if top_p is None:
        assert top_k is not None
        kmax = min(max_top_k or vocab_size, vocab_size)
        values = logits.topk(kmax, dim=-1).values  # [B, kmax], descending
        k_off = top_k <= 0
        kth = values.gather(1, (top_k.clamp(1, kmax) - 1)[:, None])  # [B, 1]
        kth.masked_fill_(k_off[:, None], float("-inf"))
        return logits.masked_fill_(logits < kth, float("-inf"))
    if top_k is not None and max_top_k is not None and top_p_rows_have_top_k:
        return _top_p_within_top_k(logits, top_k, top_p, min(max_top_k, vocab_size))
    return _top_k_top_p_sorted(logits, top_k, top_p)


def _top_k_top_p_sorted(logits: Tensor, top_k: Tensor | None, top_p: Tensor) -> Tensor:
    """`apply_top_k_top_p` with top-p by one stable sort of the whole vocabulary. [B, V], in place."""
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab_size, top_k)
        positions = torch.arange(vocab_size, device=logits.device)
        sorted_logits.masked_fill_(positions[None, :] >= k[:, None], float("-inf"))
    drop_sorted = _top_p_drop(sorted_logits, top_p)
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill_(drop, float("-inf"))


def _top_p_within_top_k(logits: Tensor, top_k: Tensor, top_p: Tensor, kmax: int) -> Tensor:
    """`apply_top_k_top_p` sorting only [B, kmax] candidates: every row with top_p < 1 has
    0 < top_k <= kmax; rows with no top_k (and so top_p = 1) are left alone. [B, V], in place."""
    has_k = top_k > 0  # [B]
    k = top_k.clamp(1, kmax)[:, None]  # [B, 1]
    kth = logits.topk(kmax, dim=-1).values.gather(1, k - 1)  # [B, 1] the k-th largest logit
    above = logits > kth  # [B, V]
    at_kth = logits == kth
    # the stable sort's first k: all tokens above the k-th value, then the lowest ids equal to it
    in_top_k = above | (
        at_kth & (at_kth.cumsum(dim=-1, dtype=torch.int32) <= k - above.sum(-1, keepdim=True))
    )
    values, ids = logits.masked_fill(~in_top_k, float("-inf")).topk(
        kmax, dim=-1
    )  # [B, kmax], top-k ⊆ ids
    ids, by_id = ids.sort(
        dim=-1
    )  # order the candidates as the stable sort does: by value, ties by id
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, by_value)
    keep = torch.zeros_like(in_top_k).scatter_(1, ids, ~_top_p_drop(values, top_p))
    return logits.masked_fill_(~keep & has_k[:, None], float("-inf"))


def _top_p_drop(sorted_logits: Tensor, top_p: Tensor) -> Tensor:
    """[B, N] logits sorted descending (-inf = already dropped) -> [B, N] bool, True where
    top-p drops the token: the probability mass before it already reaches top_p."""
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [B, N] exclusive cumulative probability
    p = torch.where(top_p >= 1.0, float("inf"), top_p)  # rounding must not cut p = 1 rows
    return (mass_before >= p[:, None]) | (sorted_logits == float("-inf"))


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """In place: drop tokens with prob < min_p * max prob, i.e. logit - max < log(min_p)."""
    max_logits = logits.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill_(logits - max_logits < min_p.log()[:, None], float("-inf"))


def _sample_random(x: Tensor, t: SamplingTensors) -> Tensor:
    """Temperature, top-k/top-p, min-p, then the exponential race. [B, V] -> [B]."""
    # Greedy rows in a mixed batch are replaced by argmax later; the clamp only
    # keeps them finite (and makes a near-zero temperature act greedy anyway).
    x = x / t.temperature.clamp_min(GREEDY_TEMPERATURE_EPS)[:, None]  # new tensor
    if not (t.no_top_k and t.no_top_p):
        apply_top_k_top_p(
            x,
            None if t.no_top_k else t.top_k,
            None if t.no_top_p else t.top_p,
            t.max_top_k,
            t.top_p_rows_have_top_k,
        )
    if not t.no_min_p:
        apply_min_p(x, t.min_p)
    probs = x.softmax(dim=-1)  # [B, V]
    noise = torch.empty_like(probs).exponential_()
    if t.seeded_rows is not None and t.seeds is not None:  # set together
        rows = t.seeded_rows
        noise[rows] = hash_exponential(t.seeds[rows], t.steps[rows], probs.shape[1]).to(noise.dtype)
    # A zero draw would turn 0/0 into NaN, which argmax would pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


def _logprob_output(
    raw: Tensor,
    token_ids: Tensor,
    num_logprobs: int,
    ranks_are_1: bool = False,
    shift: Tensor | None = None,
) -> SamplerOutput:
    """The log-softmax of the raw logits [B, V] (any float dtype) at the sampled tokens and its top
    `num_logprobs` (plus `shift` [B] per row), and each sampled token's rank (1 + tokens strictly
    more likely)."""
    k = min(num_logprobs, raw.shape[1])
    fused = cpu_ops.logprobs_topk(raw, token_ids, k)  # one op with a CPU kernel set, else None
    if fused is not None:
        sampled_logprobs, topk_logprobs, topk_ids = fused
    else:
        raw = raw.float()
        log_norm = torch.logsumexp(raw, dim=-1, keepdim=True)  # [B, 1]
        sampled_logprobs = (raw.gather(1, token_ids[:, None]) - log_norm).squeeze(1)
        topk_logprobs, topk_ids = raw.topk(k, dim=-1)
        topk_logprobs = topk_logprobs - log_norm
    if shift is not None:
        sampled_logprobs = sampled_logprobs + shift
        topk_logprobs = topk_logprobs + shift[:, None]
    if ranks_are_1:
        ranks = torch.ones_like(token_ids)
    else:  # (comparisons are exact in the logits' own dtype)
        ranks = (raw > raw.gather(1, token_ids[:, None])).sum(dim=-1) + 1
    return SamplerOutput(
        sampled_token_ids=token_ids,
        sampled_logprobs=sampled_logprobs,
        sampled_ranks=ranks,
        topk_token_ids=topk_ids if num_logprobs > 0 else None,
        topk_logprobs=topk_logprobs if num_logprobs > 0 else None,
    )


# ---- counter-based RNG for seeded requests (splitmix64 mixing on int64) ----


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _srl(x: Tensor, shift: int) -> Tensor:
    """Logical right shift on int64 (torch's >> is arithmetic: mask the sign copies)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def mix64(z: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 tensors (multiplication wraps mod 2**64)."""
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def hash_uniform(seeds: Tensor, steps: Tensor, num_cols: int) -> Tensor:
    """[S], [S] int64 -> [S, num_cols] float64 uniforms in (0, 1), a pure function of
    (seed, step, column): output `j` of a splitmix64 stream keyed by (seed, step)."""
    key = mix64(mix64(seeds) + (steps + 1) * _GOLDEN)  # [S]
    cols = (torch.arange(1, num_cols + 1, dtype=torch.int64, device=seeds.device)) * _GOLDEN
    bits = _srl(mix64(key[:, None] + cols[None, :]), 12)  # [S, num_cols], 52 random bits
    return (bits.double() + 0.5) * 2.0**-52  # in [2**-53, 1 - 2**-53]


def hash_exponential(seeds: Tensor, steps: Tensor, num_cols: int) -> Tensor:
    """Exp(1) draws [S, num_cols] float64, strictly positive and finite."""
    return hash_uniform(seeds, steps, num_cols).log_().neg_()


# ---- host-side builders ----


def _per_row(values: Sequence[Any] | None, default: object, num_reqs: int) -> list[Any]:
    if values is None:
        return [default] * num_reqs
    if len(values) != num_reqs:
        raise ValueError(f"expected {num_reqs} values, got {len(values)}")
    return list(values)


def _to_int64(value: int) -> int:
    """Any Python int -> the int64 with the same low 64 bits (seeds may be large)."""
    return _signed(value & ((1 << 64) - 1))


def _to_device(array: np.ndarray, device: torch.device | str) -> Tensor:
    tensor = torch.from_numpy(array)
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str) -> Tensor:
    """Ragged id lists -> [B, max_len] int64 padded with pad_id (at least 1 column)."""
    max_len = max((len(r) for r in rows), default=0)
    array = np.full((len(rows), max(max_len, 1)), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        array[i, : len(row)] = row
    return _to_device(array, device)
