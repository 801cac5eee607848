"""Prometheus metrics (names mirror vLLM's, prefixed `kvserve:`, all labelled `model_name`).

Engine-owned numbers (running/waiting, KV usage, cumulative token and prefix-cache
counters) are read from `engine.stats()` at scrape time by a custom collector, so the
server never keeps a second copy that could drift. Per-request latencies are observed
from `RequestOutput.metrics` timestamps as requests finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

logger = logging.getLogger("kvserve.server")

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
THROUGHPUT_WINDOW_S = 10.0


@dataclass(frozen=True, slots=True)
class _Sample:
    time: float
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int


class Throughput:
    """Token rates over the last `window_s` seconds, from the engine's cumulative counters."""

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[_Sample] = deque()

    def add(self, stats: Any, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append(
            _Sample(
                now,
                stats.prompt_tokens_total,
                stats.generation_tokens_total,
                stats.prefix_cache_queries_total,
                stats.prefix_cache_hits_total,
            )
        )
        # Keep one sample older than the window so the rate always spans the whole window.
        while len(self._samples) > 2 and self._samples[1].time <= now - self.window_s:
            self._samples.popleft()

    def rates(self) -> tuple[float, float, float]:
        """(prompt tokens/s, generation tokens/s, prefix-cache hit rate) over the window."""
        if len(self._samples) < 2:
            return 0.0, 0.0, 0.0
        first, last = self._samples[0], self._samples[-1]
        dt = last.time - first.time
        if dt <= 0:
            return 0.0, 0.0, 0.0
        queries = last.prefix_queries - first.prefix_queries
        hit_rate = (last.prefix_hits - first.prefix_hits) / queries if queries > 0 else 0.0
        return (
            (last.prompt_tokens - first.prompt_tokens) / dt,
            (last.generation_tokens - first.generation_tokens) / dt,
            hit_rate,
        )


class _EngineCollector(Collector):
    """Reads `engine.stats()` at every scrape."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.metrics.engine.stats()
        except Exception:  # a dead engine must not break /metrics; /health reports it
            logger.warning("engine.stats() failed during a scrape", exc_info=True)
            return
        self.metrics.throughput.add(stats)
        prompt_rate, generation_rate, _ = self.metrics.throughput.rates()
        label = [self.metrics.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"kvserve:{name}", doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"kvserve:{name}", doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", stats.kv_cache_usage
        )
        yield gauge(
            "kv_cache_blocks_total", "KV-cache blocks in the pool.", stats.num_kv_blocks_total
        )
        window = f"over the last {self.metrics.throughput.window_s:g} s"
        yield gauge("prompt_throughput_toks_per_s", f"Prompt tokens/s {window}.", prompt_rate)
        yield gauge(
            "generation_throughput_toks_per_s", f"Generated tokens/s {window}.", generation_rate
        )
        yield counter(
            "prompt_tokens",
            "Prompt tokens of the requests started, each counted once (cached ones included).",
            stats.prompt_tokens_total,
        )
        yield counter(
            "prompt_tokens_cached",
            "Prompt tokens found in the prefix cache when their request started.",
            stats.prompt_tokens_cached_total,
        )
        yield counter(
            "prompt_tokens_computed",
            "Prompt tokens run through the model (again after a preemption).",
            stats.prompt_tokens_computed_total,
        )
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries_total,
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hits_total,
        )
        yield counter(
            "num_preemptions",
            "Requests preempted for lack of KV blocks.",
            stats.num_preemptions_total,
        )
        yield gauge(
            "num_requests_compiling",
            "Requests waiting for their grammar to compile.",
            stats.num_compiling,
        )
        yield gauge(
            "num_grammars_compiling",
            "Distinct grammars queued or compiling, also those no request waits for any more.",
            getattr(stats, "num_grammars_compiling", 0),
        )
        yield counter(
            "structured_output_requests",
            "Requests with an output constraint (response_format, guided_*).",
            stats.structured_requests_total,
        )
        yield counter(
            "spec_decode_num_drafts",
            "Speculative decoding: request-steps that verified draft tokens.",
            getattr(stats, "spec_verifications_total", 0),
        )
        yield counter(
            "spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified.",
            getattr(stats, "spec_draft_tokens_total", 0),
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted (each one a "
            "token generated without a step of its own).",
            getattr(stats, "spec_accepted_tokens_total", 0),
        )
        info = self.metrics.engine.model_config
        weights = GaugeMetricFamily(
            "kvserve:model_weight_bytes",
            "Resident bytes of the model's weights (this "
            "process's share under tensor parallelism), by format: none (the model dtype), "
            "int8 or int4.",
            labels=["model_name", "quantization"],
        )
        weights.add_metric([self.metrics.model_name, info.quantization], info.weight_bytes)
        yield weights
        compile_time = SummaryMetricFamily(
            "kvserve:grammar_compile_seconds",
            "Grammar compile time (count: compiles, cache misses only).",
            labels=["model_name"],
        )
        compile_time.add_metric(
            label, stats.grammar_compiles_total, stats.grammar_compile_seconds_total
        )
        yield compile_time


class ServerMetrics:
    """All of the server's metrics, in a registry of their own (one per app)."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.throughput = Throughput()
        self.registry.register(_EngineCollector(self))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"kvserve:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between successive outputs.", TOKEN_LATENCY_BUCKETS
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS
        )
        self.request_success = Counter(
            "kvserve:request_success",
            "Finished choices by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in ("stop", "length"):  # exported (as 0) from the start
            self.request_success.labels(model_name, reason)
        self.lora_requests_running = Gauge(
            "kvserve:lora_requests_running",
            "Requests in flight (admitted, not finished) per LoRA adapter.",
            ["model_name", "lora_name"],
            registry=self.registry,
        )

    def lora_gauge(self, lora_name: str | None) -> Gauge | None:
        """The adapter's in-flight gauge (None: the base model)."""
        return (
            None
            if lora_name is None
            else self.lora_requests_running.labels(self.model_name, lora_name)
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)

    async def run_stats_logger(self, log_interval_s: float, sample_interval_s: float = 1.0) -> None:
        """Sample the engine every second (for the rates); log one line every `log_interval_s` while busy."""
        last_log = time.monotonic()
        is_busy = False
        while True:
            await asyncio.sleep(sample_interval_s)
            try:
                stats = self.engine.stats()
            except Exception:
                continue
            self.throughput.add(stats)
            is_busy = is_busy or stats.num_running > 0 or stats.num_waiting > 0
            now = time.monotonic()
            if log_interval_s > 0 and now - last_log >= log_interval_s:
                if is_busy:
                    logger.info(self.stats_line(stats))
                last_log, is_busy = now, stats.num_running > 0 or stats.num_waiting > 0

    def stats_line(self, stats: Any) -> str:
        prompt_rate, generation_rate, hit_rate = self.throughput.rates()
        line = (
            f"prompt throughput: {prompt_rate:.1f} tokens/s, generation throughput: {generation_rate:.1f} "
            f"tokens/s, running: {stats.num_running} reqs, waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, prefix cache hit rate: {100 * hit_rate:.1f}%"
        )
        drafts = getattr(stats, "spec_draft_tokens_total", 0)
        if drafts:  # since start: speculative decoding is on and has proposed something
            accepted, verifications = (
                stats.spec_accepted_tokens_total,
                stats.spec_verifications_total,
            )
            line += (
                f", draft acceptance since start: {100 * accepted / drafts:.1f}% "
                f"({accepted / verifications:.2f} accepted per verification)"
            )
        return line


class RequestTracker:
    """Observes one engine request's outputs and records its latencies when it finishes."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.prev_token_time: float | None = None

    def observe(self, output: Any) -> None:
        timings = getattr(output, "metrics", None)
        if any(c.delta_token_ids for c in output.outputs):
            token_time = getattr(timings, "last_token_time", None) or time.monotonic()
            if self.prev_token_time is not None:
                self.metrics.inter_token_latency.observe(
                    max(token_time - self.prev_token_time, 0.0)
                )
            self.prev_token_time = token_time
        if output.finished:
            self._finished(output, timings)

    def _finished(self, output: Any, timings: Any) -> None:
        m = self.metrics
        for choice in output.outputs:
            if choice.finish_reason in ("stop", "length"):
                m.request_success.labels(m.model_name, choice.finish_reason).inc()
        if timings is None:
            return
        arrival = timings.arrival_time
        first_token = timings.first_token_time
        finished = timings.finished_time or timings.last_token_time
        if timings.first_scheduled_time is not None:
            m.queue_time.observe(max(timings.first_scheduled_time - arrival, 0.0))
        if first_token is not None:
            m.time_to_first_token.observe(max(first_token - arrival, 0.0))
        if finished is not None:
            m.e2e_latency.observe(max(finished - arrival, 0.0))
        num_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        if first_token is not None and timings.last_token_time is not None and num_tokens > 1:
            m.time_per_output_token.observe(
                max(timings.last_token_time - first_token, 0.0) / (num_tokens - 1)
            )
