"""Server-side view of a run: scrape kvserve's Prometheus `/metrics` periodically.

Client timings say how the service felt; these say why (KV cache pressure,
queueing, preemptions, prefix-cache hits). Counters are reported as deltas over
the run, so a server that has been up for a while is measured fairly.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Prometheus sample name -> short key used in result.json.
METRICS = {
    "kvserve:kv_cache_usage_perc": "kv_cache_usage",  # fraction 0..1
    "kvserve:num_requests_running": "num_running",
    "kvserve:num_requests_waiting": "num_waiting",
    "kvserve:prefix_cache_queries_total": "prefix_cache_queries",
    "kvserve:prefix_cache_hits_total": "prefix_cache_hits",
    "kvserve:num_preemptions_total": "num_preemptions",
    "kvserve:generation_tokens_total": "generation_tokens",
}
_MAX_OVER_LABELS = {"kv_cache_usage"}  # a fraction: summing over models makes no sense


def parse_metrics(text: str) -> dict[str, float]:
    """Known kvserve samples from a /metrics body, aggregated over label sets
    (e.g. `model_name`): max for the KV usage fraction, sum for the rest."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = METRICS.get(sample.name)
            if key is None:
                continue
            if key in values:
                combine = max if key in _MAX_OVER_LABELS else (lambda a, b: a + b)
                values[key] = combine(values[key], sample.value)
            else:
                values[key] = sample.value
    return values


@dataclass(slots=True)
class MetricsSample:
    t: float  # time.perf_counter() when scraped
    values: dict[str, float]


def _delta(first: dict[str, float], last: dict[str, float], key: str) -> float | None:
    if key not in first or key not in last:
        return None
    return last[key] - first[key]


def summarize_samples(
    samples: list[MetricsSample], kv_back_to_zero: bool | None, drain_s: float | None
) -> dict:
    """Peak KV use, prefix-cache hit rate, preemptions and tokens over the run."""
    if not samples:
        return {"available": False}
    first, last = samples[0].values, samples[-1].values
    kv = [s.values["kv_cache_usage"] for s in samples if "kv_cache_usage" in s.values]
    queries = _delta(first, last, "prefix_cache_queries")
    hits = _delta(first, last, "prefix_cache_hits")
    peak = lambda key: max((s.values.get(key, 0.0) for s in samples), default=None)  # noqa: E731
    return {
        "available": True,
        "num_samples": len(samples),
        "peak_kv_cache_usage": max(kv) if kv else None,
        "mean_kv_cache_usage": sum(kv) / len(kv) if kv else None,
        "peak_num_running": peak("num_running"),
        "peak_num_waiting": peak("num_waiting"),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries and hits is not None else None,
        "num_preemptions": _delta(first, last, "num_preemptions"),
        "generation_tokens": _delta(first, last, "generation_tokens"),
        "kv_cache_back_to_zero": kv_back_to_zero,
        "seconds_to_zero_after_run": drain_s,
    }


class MetricsScraper:
    """Polls `/metrics` in the background of the run's event loop."""

    def __init__(self, client: httpx.AsyncClient, url: str, interval_s: float = 0.5) -> None:
        self.client, self.url, self.interval_s = client, url, interval_s
        self.samples: list[MetricsSample] = []
        self.available = False
        self._task: asyncio.Task | None = None

    async def scrape(self) -> dict[str, float] | None:
        try:
            resp = await self.client.get(self.url, timeout=5.0)
            if resp.status_code != 200:
                return None
            values = parse_metrics(resp.text)
        except (httpx.HTTPError, ValueError):
            return None  # a missed sample is not worth failing a benchmark over
        if values:
            self.samples.append(MetricsSample(time.perf_counter(), values))
        return values or None

    async def start(self) -> bool:
        """Take the baseline sample; start polling if kvserve metrics exist."""
        self.available = await self.scrape() is not None
        if self.available:
            self._task = asyncio.create_task(self._poll())
        return self.available

    def series(self, origin: float) -> list[dict]:
        """Samples as dicts with `t_s` = seconds since `origin` (the run start)."""
        return [{"t_s": s.t - origin, **s.values} for s in self.samples]

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape()

    async def stop(self, drain_timeout_s: float = 5.0) -> dict:
        """Stop polling, wait (up to a deadline) for the server to go idle, summarize."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if not self.available:
            return {"available": False}
        back_to_zero, drain_s = await self._wait_idle(drain_timeout_s)
        return summarize_samples(self.samples, back_to_zero, drain_s)

    async def _wait_idle(self, timeout_s: float) -> tuple[bool | None, float | None]:
        """True once KV use and running requests are 0 (cancelled requests freed)."""
        t0 = time.perf_counter()
        while True:
            values = await self.scrape()
            if values is not None and "kv_cache_usage" in values:
                if values["kv_cache_usage"] == 0 and values.get("num_running", 0) == 0:
                    return True, time.perf_counter() - t0
            elif values is not None:
                return None, None  # the server does not export KV usage
            if time.perf_counter() - t0 > timeout_s:
                return False, None
            await asyncio.sleep(0.25)
