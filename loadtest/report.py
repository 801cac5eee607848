"""Turn request records into summary figures, a terminal table and result.json.

All functions here are pure (records in, numbers out) so the math is tested on
synthetic records. Latency statistics use completed requests only; failed and
deliberately disconnected requests are counted but never averaged in.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np

from kvserve.loadtest.client import DISCONNECTED, FAILED, OK, RequestRecord

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        key, sep, value = spec.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad --goodput {spec!r}: expected one of {SLO_KEYS} as KEY:MS")
        ms = float(value)
        if not ms > 0:
            raise ValueError(f"bad --goodput {spec!r}: the limit must be > 0 ms")
        slos[key] = ms
    return slos


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    """mean and percentiles in milliseconds; None when there are no values."""
    if not values_s:
        return {"mean_ms": None, **{f"p{p}_ms": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {
        "mean_ms": float(ms.mean()),
        **{f"p{p}_ms": float(np.percentile(ms, p)) for p in PERCENTILES},
    }


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """True when a completed request is within every SLO (TPOT of 1-token outputs is 0)."""
    if record.status != OK:
        return False
    measured = {
        "ttft": record.ttft_s,
        "tpot": record.tpot_s if record.tpot_s is not None else 0.0,
        "e2el": record.e2e_s,
    }
    return all(
        (value := measured[k]) is not None and value * 1000.0 <= limit for k, limit in slos.items()
    )


def peak_concurrency(records: list[RequestRecord]) -> int:
    """Most requests in flight at once, from their send and end times."""
    events = sorted(
        [(r.sent_s, 1) for r in records if r.e2e_s is not None]
        + [(r.sent_s + r.e2e_s, -1) for r in records if r.e2e_s is not None],
        key=lambda e: (e[0], e[1]),  # ends before starts at the same instant
    )
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def summarize(records: list[RequestRecord], duration_s: float, slos: dict[str, float]) -> dict:
    """The run's headline figures (see docs/loadtest.md for each one)."""
    ok = [r for r in records if r.status == OK]
    failed = [r for r in records if r.status == FAILED]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(
        r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok
    )
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)  # noqa: E731
    good = sum(meets_slos(r, slos) for r in ok) if slos else None
    return {
        "num_sent": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "disconnected": sum(r.status == DISCONNECTED for r in records),
        "failure_reasons": dict(Counter(r.error or "unknown" for r in failed).most_common()),
        "duration_s": duration_s,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "output_tokens_all_requests": sum(r.output_tokens for r in records),
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(prompt_tokens + output_tokens),
        "peak_concurrency": peak_concurrency(records),
        "usage_reported": all(r.has_usage for r in ok),
        "ttft": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot": latency_stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl": latency_stats([x for r in ok for x in r.itl_s]),
        "e2el": latency_stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "goodput_slos_ms": slos or None,
        "good_requests": good,
        "goodput": per_s(good) if good is not None else None,
    }


def fmt_number(value: float | int | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def format_table(
    summary: dict, server: dict | None = None, title: str = "Serving Benchmark Result"
) -> str:
    """A fixed-width text report for the terminal."""
    width = 56
    rows: list[str] = [f" {title} ".center(width, "=")]
    line = lambda label, value: rows.append(f"{label:<40}{value:>16}")  # noqa: E731
    line("Completed requests:", fmt_number(summary["completed"]))
    line("Failed requests:", fmt_number(summary["failed"]))
    for reason, count in list(summary["failure_reasons"].items())[:5]:
        rows.append(f"  {count:>5} x {reason[: width - 10]}")
    line("Disconnected (by design):", fmt_number(summary["disconnected"]))
    line("Peak concurrency (client side):", fmt_number(summary["peak_concurrency"]))
    line("Benchmark duration (s):", fmt_number(summary["duration_s"]))
    line("Total input tokens:", fmt_number(summary["total_prompt_tokens"]))
    line("Total generated tokens:", fmt_number(summary["total_output_tokens"]))
    line("Request throughput (req/s):", fmt_number(summary["request_throughput"]))
    line("Output token throughput (tok/s):", fmt_number(summary["output_throughput"]))
    line("Total token throughput (tok/s):", fmt_number(summary["total_token_throughput"]))
    if summary["goodput"] is not None:
        slos = ", ".join(f"{k}<={v:g}ms" for k, v in summary["goodput_slos_ms"].items())
        line(f"Goodput (req/s, {slos}):"[:40], fmt_number(summary["goodput"]))
    for key, name in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        rows.append(f" {name} ".center(width, "-"))
        stats = summary[key]
        line(f"Mean {key.upper()} (ms):", fmt_number(stats["mean_ms"]))
        for p in PERCENTILES:
            line(f"P{p} {key.upper()} (ms):", fmt_number(stats[f"p{p}_ms"]))
    if server and server.get("available"):
        rows.append(" Server metrics (/metrics) ".center(width, "-"))
        kv_peak = server["peak_kv_cache_usage"]
        line(
            "Peak KV cache usage (%):",
            fmt_number(kv_peak * 100 if kv_peak is not None else None, 1),
        )
        rate = server["prefix_cache_hit_rate"]
        line("Prefix cache hit rate (%):", fmt_number(rate * 100 if rate is not None else None, 1))
        line("Preemptions during run:", fmt_number(server["num_preemptions"], 0))
        line(
            "Peak running / waiting:",
            f"{fmt_number(server['peak_num_running'], 0)} / "
            f"{fmt_number(server['peak_num_waiting'], 0)}",
        )
        line("KV cache back to 0 after run:", fmt_number(server["kv_cache_back_to_zero"]))
    rows.append("=" * width)
    return "\n".join(rows)


def json_safe(obj: object) -> object:
    """Infinite/NaN floats as strings ("inf"), so files are strict JSON for any reader."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def dump_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(json_safe(obj), indent=1, default=str, allow_nan=False) + "\n")


def write_result(
    path: Path,
    config: dict,
    summary: dict,
    server: dict,
    records: list[RequestRecord],
    series: list[dict],
) -> None:
    """result.json: everything needed to redo the analysis without rerunning."""
    doc = {
        "config": config,
        "summary": summary,
        "server_metrics": server,
        "metrics_series": series,
        "requests": [r.to_dict() for r in records],
    }
    dump_json(path, doc)


def markdown_table(points: list[dict], first_column: str = "load") -> str:
    """One row per sweep point; each point is {'label', 'summary', 'server'}."""
    header = (
        f"| {first_column} | ok / failed / disc. | req/s | out tok/s | TTFT p50 (ms) | TTFT p99 (ms) "
        "| TPOT p50 (ms) | TPOT p99 (ms) | E2E p50 (ms) | peak KV % | prefix hit % |"
    )
    rows = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for p in points:
        s, server = p["summary"], p.get("server") or {}
        kv = server.get("peak_kv_cache_usage")
        kv_percent = kv * 100 if kv is not None else None
        hits = server.get("prefix_cache_hit_rate")
        hit_percent = hits * 100 if hits is not None else None
        rows.append(
            f"| {p['label']} | {s['completed']} / {s['failed']} / {s['disconnected']} "
            f"| {fmt_number(s['request_throughput'])} | {fmt_number(s['output_throughput'], 1)} "
            f"| {fmt_number(s['ttft']['p50_ms'], 1)} | {fmt_number(s['ttft']['p99_ms'], 1)} "
            f"| {fmt_number(s['tpot']['p50_ms'], 1)} | {fmt_number(s['tpot']['p99_ms'], 1)} "
            f"| {fmt_number(s['e2el']['p50_ms'], 1)} | {fmt_number(kv_percent, 1)} "
            f"| {fmt_number(hit_percent, 1)} |"
        )
    return "\n".join(rows)
