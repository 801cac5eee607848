"""PNG plots of a run (from its result.json document) and of a sweep.

Everything takes the plain dicts written to result.json, so plots can be
redrawn later from a saved file: `plot_run(json.load(f), out_dir)`.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on servers or CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def token_times(records: list[dict]) -> np.ndarray:
    """Arrival time (s from run start) of every received output token.

    Tokens of the first chunk arrive at TTFT; each later one follows by its ITL.
    """
    times: list[float] = []
    for r in records:
        if r["ttft_s"] is None:
            continue
        t = r["sent_s"] + r["ttft_s"]
        times.extend([t] * max(r["output_tokens"] - len(r["itl_s"]), 1))
        times.extend((t + np.cumsum(r["itl_s"])).tolist())
    return np.asarray(times)


def inflight_series(records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Step function (times, number of requests in flight) from send/end times."""
    events = sorted(
        [(r["sent_s"], 1) for r in records if r["e2e_s"] is not None]
        + [(r["sent_s"] + r["e2e_s"], -1) for r in records if r["e2e_s"] is not None]
    )
    if not events:
        return np.zeros(1), np.zeros(1)
    t, step = zip(*events)
    return np.asarray(t), np.cumsum(step)


def _ecdf(ax: plt.Axes, values_s: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.grid(alpha=0.3)
    if not values_s:
        ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
        return
    ms = np.sort(np.asarray(values_s) * 1000.0)
    ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
    for p, style in ((50, "--"), (99, ":")):
        ax.axvline(np.percentile(ms, p), color="gray", linestyle=style, label=f"p{p}")
    ax.legend(loc="lower right")


def plot_latency_cdfs(records: list[dict], path: Path) -> Path:
    ok = [r for r in records if r["status"] == "ok"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    _ecdf(axes[0], [r["ttft_s"] for r in ok if r["ttft_s"] is not None], "TTFT")
    _ecdf(axes[1], [x for r in ok for x in r["itl_s"]], "Inter-token latency")
    _ecdf(axes[2], [r["e2e_s"] for r in ok if r["e2e_s"] is not None], "End-to-end latency")
    axes[0].set_ylabel("fraction of requests (ITL: of tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(records: list[dict], series: list[dict], duration_s: float, path: Path) -> Path:
    """Output tokens/s and requests in flight over time (client and server view)."""
    fig, (ax_tp, ax_cc) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    bin_s = max(0.25, round(duration_s / 30, 1))  # ~30 bins: smooth enough to read
    edges = np.arange(0.0, max(duration_s, bin_s) + bin_s, bin_s)
    counts, _ = np.histogram(token_times(records), bins=edges)
    ax_tp.step(edges[:-1], counts / bin_s, where="post", label="received by client")
    gen = [(s["t_s"], s["generation_tokens"]) for s in series if "generation_tokens" in s]
    if len(gen) > 1:
        t, tokens = np.asarray(gen).T
        ax_tp.plot(
            t[1:],
            np.diff(tokens) / np.maximum(np.diff(t), 1e-9),
            "o-",
            ms=3,
            label="generated (server /metrics)",
        )
    ax_tp.set_ylabel("output tokens/s")
    ax_tp.legend()
    ax_tp.grid(alpha=0.3)
    t, inflight = inflight_series(records)
    ax_cc.step(t, inflight, where="post", label="in flight (client)")
    for key, label in (("num_running", "running (server)"), ("num_waiting", "waiting (server)")):
        points = [(s["t_s"], s[key]) for s in series if key in s]
        if points:
            ax_cc.plot(*np.asarray(points).T, ".-", label=label)
    ax_cc.set_ylabel("requests")
    ax_cc.set_xlabel("seconds since start")
    ax_cc.legend()
    ax_cc.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_kv_cache(series: list[dict], duration_s: float, path: Path) -> Path | None:
    points = [(s["t_s"], s["kv_cache_usage"] * 100) for s in series if "kv_cache_usage" in s]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(*np.asarray(points).T, ".-", label="KV cache usage")
    ax.axvline(duration_s, color="gray", linestyle="--", label="last request done")
    ax.set_ylim(0, 105)
    ax.set_ylabel("% of KV blocks in use")
    ax.set_xlabel("seconds since start")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(doc: dict, out_dir: Path) -> list[Path]:
    """All per-run plots; returns the files written."""
    records, series = doc["requests"], doc["metrics_series"]
    duration_s = doc["summary"]["duration_s"]
    paths = [
        plot_latency_cdfs(records, out_dir / "latency_cdf.png"),
        plot_timeline(records, series, duration_s, out_dir / "timeline.png"),
        plot_kv_cache(series, duration_s, out_dir / "kv_cache.png"),
    ]
    return [p for p in paths if p is not None]


def plot_sweep(points: list[dict], path: Path) -> Path:
    """Throughput vs latency across sweep points (each: {'label', 'summary'})."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    x = [p["summary"]["output_throughput"] or 0.0 for p in points]
    for ax, key, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for pct, marker in (("p50", "o-"), ("p99", "s--")):
            y = [p["summary"][key][f"{pct}_ms"] for p in points]
            y = [np.nan if v is None else v for v in y]
            ax.plot(x, y, marker, label=f"{name} {pct}")
        for xi, p in zip(x, points):
            v = p["summary"][key]["p50_ms"]
            if v is not None:
                ax.annotate(
                    p["label"], (xi, v), textcoords="offset points", xytext=(4, 4), fontsize=8
                )
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{name} (ms)")
        if any((p["summary"][key]["p50_ms"] or 0) > 0 for p in points):
            ax.set_yscale("log")  # latencies span orders of magnitude across a sweep
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
