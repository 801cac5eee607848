"""Request arrival schedules.

A schedule is a pure function of (rate, burstiness, count, seed): it returns the
offsets in seconds, from the start of the run, at which each request is due.
Nothing here sleeps, so the statistics are unit-testable; `bench.py` does the
waiting. Inter-arrival gaps are gamma-distributed with shape = burstiness and
mean = 1 / rate: burstiness 1 is a Poisson process, < 1 is burstier (CV > 1),
> 1 is more regular (CV = 1 / sqrt(burstiness)).
"""

from __future__ import annotations

import math

import numpy as np


def _check(request_rate: float, burstiness: float) -> None:
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")


def inter_arrival_gaps(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Gaps (seconds) between consecutive requests; all zeros for rate = inf."""
    _check(request_rate, burstiness)
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    # Gamma(shape=k, scale=theta) has mean k * theta, so theta = 1 / (rate * k).
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send time of each request relative to the run start; the first is at 0."""
    gaps = inter_arrival_gaps(num_requests, request_rate, burstiness, seed)
    if num_requests == 0:
        return []
    offsets = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    return offsets.tolist()


def arrival_offsets_for_duration(
    duration_s: float, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """All arrivals due before `duration_s` (finite rates only).

    Generated in chunks from one seeded stream, so the result is the prefix of
    the same process that `arrival_offsets` would draw with a larger count.
    """
    _check(request_rate, burstiness)
    if math.isinf(request_rate):
        raise ValueError("an infinite rate has no finite schedule for a duration")
    num_requests = max(16, int(duration_s * request_rate * 1.5) + 16)
    while True:
        offsets = arrival_offsets(num_requests, request_rate, burstiness, seed)
        if offsets[-1] >= duration_s:
            return [t for t in offsets if t < duration_s]
        num_requests *= 2
