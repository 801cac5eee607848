"""Run one load point: dispatch requests on schedule, collect records and metrics.

The dispatcher is a single loop: wait for a concurrency slot (if capped), then
for the request's due time, then start its task. So a request is sent at
max(due time, time a slot frees up), and `sent_s - scheduled_s` shows how long
the client-side cap held it back.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import httpx
import numpy as np
from tqdm import tqdm

from kvserve.loadtest.arrivals import arrival_offsets, arrival_offsets_for_duration
from kvserve.loadtest.client import OK, RequestRecord, build_payload, send_request
from kvserve.loadtest.datasets import BenchRequest
from kvserve.loadtest.metrics_scraper import MetricsScraper

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class RunConfig:
    """One load point. `num_prompts` or `duration_s` bounds it."""

    base_url: str
    model: str
    endpoint: str = "completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_prompts: int | None = 100
    duration_s: float | None = None
    disconnect_fraction: float = 0.0
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0
    api_key: str | None = None
    show_progress: bool = True
    metrics_interval_s: float = 0.5
    drain_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(
                f"endpoint must be one of {list(ENDPOINT_PATHS)}, got {self.endpoint!r}"
            )
        if (self.num_prompts is None) == (self.duration_s is None):
            raise ValueError("set exactly one of num_prompts and duration_s")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not 0 <= self.disconnect_fraction <= 1:
            raise ValueError(
                f"disconnect_fraction must be in [0, 1], got {self.disconnect_fraction}"
            )
        if (
            self.duration_s is not None
            and math.isinf(self.request_rate)
            and not self.max_concurrency
        ):
            raise ValueError("--duration with an infinite rate needs --max-concurrency")

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "api_key"}


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # run start -> end of the last request
    server: dict  # metrics_scraper.summarize_samples output
    series: list[dict]  # /metrics samples, t_s from the run start


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def plan_disconnects(output_lens: list[int], fraction: float, seed: int) -> list[int | None]:
    """For each request: None, or the number of chunks after which to hang up.

    Exactly round(fraction * n) requests are picked; each hangs up after a
    uniform 0..output_len-1 chunks (0 = right after the response headers, which
    cancels a request that may still be queued).
    """
    rng = np.random.default_rng([seed, 1])  # independent of the arrival stream
    n = len(output_lens)
    picked = set(rng.permutation(n)[: round(fraction * n)].tolist())
    return [
        int(rng.integers(0, max(out, 1))) if i in picked else None
        for i, out in enumerate(output_lens)
    ]


def _schedule(cfg: RunConfig, num_requests: int) -> Iterable[float]:
    if cfg.duration_s is None:
        return arrival_offsets(num_requests, cfg.request_rate, cfg.burstiness, cfg.seed)
    if math.isinf(cfg.request_rate):
        return itertools.repeat(0.0)  # closed loop: the concurrency cap paces it
    return arrival_offsets_for_duration(cfg.duration_s, cfg.request_rate, cfg.burstiness, cfg.seed)


def fetch_model_name(base_url: str, api_key: str | None = None) -> str:
    """The first model listed by GET /v1/models."""
    resp = httpx.get(f"{base_url}/v1/models", headers=auth_headers(api_key), timeout=30.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def probe(cfg: RunConfig, request: BenchRequest) -> RequestRecord:
    """One short request before the run, to fail fast on a wrong URL or model.

    The prompt is reversed so that it does not seed the prefix cache for the run.
    """
    short = BenchRequest(request.prompt[::-1], request.prompt_len, min(request.output_len, 4))
    record = RequestRecord(
        index=-1, prompt_len=short.prompt_len, max_tokens=short.output_len, scheduled_s=0
    )
    async with httpx.AsyncClient(
        headers=auth_headers(cfg.api_key), timeout=cfg.timeout_s
    ) as client:
        payload = build_payload(cfg.endpoint, cfg.model, short, cfg.ignore_eos, cfg.temperature)
        url = cfg.base_url + ENDPOINT_PATHS[cfg.endpoint]
        return await send_request(client, url, payload, record, cfg.endpoint, time.perf_counter())


async def run_benchmark(cfg: RunConfig, requests: list[BenchRequest], label: str = "") -> RunResult:
    """Send `requests` (cycled in duration mode) at the configured load."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    url = cfg.base_url + ENDPOINT_PATHS[cfg.endpoint]
    disconnects = plan_disconnects(
        [r.output_len for r in requests], cfg.disconnect_fraction, cfg.seed
    )
    semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    async with httpx.AsyncClient(
        headers=auth_headers(cfg.api_key), timeout=timeout, limits=limits
    ) as client:
        scraper = MetricsScraper(client, f"{cfg.base_url}/metrics", cfg.metrics_interval_s)
        await scraper.start()
        total = cfg.num_prompts if cfg.duration_s is None else None
        pbar = tqdm(
            total=total, desc=label or "requests", unit="req", disable=not cfg.show_progress
        )
        run_start = time.perf_counter()
        not_ok: Counter[str] = Counter()  # shown next to the progress bar

        async def one(record: RequestRecord, req: BenchRequest) -> RequestRecord:
            try:
                payload = build_payload(
                    cfg.endpoint, cfg.model, req, cfg.ignore_eos, cfg.temperature
                )
                return await send_request(client, url, payload, record, cfg.endpoint, run_start)
            finally:
                if semaphore is not None:
                    semaphore.release()
                if record.status != OK:
                    not_ok[record.status] += 1
                    pbar.set_postfix(not_ok, refresh=False)
                pbar.update(1)

        tasks: list[asyncio.Task] = []
        for i, offset in enumerate(_schedule(cfg, len(requests))):
            if cfg.duration_s is None and i >= len(requests):
                break
            if semaphore is not None:
                await semaphore.acquire()
            now = time.perf_counter() - run_start
            if cfg.duration_s is not None and max(now, offset) >= cfg.duration_s:
                if semaphore is not None:
                    semaphore.release()
                break
            if offset > now:
                await asyncio.sleep(offset - now)
            req = requests[i % len(requests)]
            record = RequestRecord(
                i,
                req.prompt_len,
                req.output_len,
                offset,
                disconnect_after_chunks=disconnects[i % len(requests)],
            )
            tasks.append(asyncio.create_task(one(record, req)))
        records = list(await asyncio.gather(*tasks))
        pbar.close()
        ends = [r.sent_s + r.e2e_s for r in records if r.e2e_s is not None]
        duration_s = max(ends, default=0.0)
        server = await scraper.stop(cfg.drain_timeout_s)
        return RunResult(records, duration_s, server, scraper.series(run_start))
