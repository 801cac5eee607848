"""Soak test: minutes of mixed, partly hostile traffic against kvserve, watching memory and the KV cache.

    python -m benchmarks.soak --model PATH --minutes 10 --restart-at 0.5    # starts (and restarts) its own server
    python -m benchmarks.soak --url http://127.0.0.1:8000 --server-pid PID --minutes 10

Each of `--concurrency` workers loops over requests: streaming and non-streaming completions;
`--disconnect-fraction` of them hang up mid-stream, `--stall-fraction` stop reading for
`--stall-seconds` and then hang up, `--oversized-fraction` send a prompt that cannot fit the
context (must get a 400). With `--restart-at F` (own server only) the server gets SIGTERM at
that fraction of the run while the load goes on: it must drain, exit 0, and is started again.

Every `--interval` seconds it prints the RSS of the server process and of its engine core
(from /proc), KV-cache use and running/waiting requests (from /metrics), and request counts.
At the end it stops the load, waits for the server to go idle, prints a summary, and exits 1
if KV use or running/waiting requests did not return to 0, if a process's RSS grew by more
than `--max-rss-growth-mib` over its value after the warm-up, if a drained server did not
exit 0, or if any request failed unexpectedly (a 5xx other than a 503, a hang, a broken stream).
Not part of the unit suite (STYLE.md §15): docs/loadtest.md, "Soak".
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.procs import free_port, stop, wait_healthy
from kvserve.loadtest.metrics_scraper import parse_metrics

WORDS = (
    "the quick brown fox jumps over lazy dog a server streams tokens while clients come and go "
    "memory should stay flat under load every block returns to the pool"
).split()
# outcomes that are part of the plan; anything in `failures` fails the run
EXPECTED = ("ok", "disconnected", "stalled", "rejected", "refused", "cut", "unavailable")


@dataclass
class Server:
    """The server under test: its URL, and its process when this script started it."""

    url: str
    pid: int | None = None
    proc: subprocess.Popen | None = None
    cmd: list[str] = field(default_factory=list)
    log_path: Path | None = None
    restart_codes: list[int] = field(default_factory=list)

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pid = self.proc.pid
        wait_healthy(self.url, self.proc, self.log_path, 300.0)

    def restart(self) -> None:
        """SIGTERM (the drain), wait for exit, start again."""
        self.proc.send_signal(signal.SIGTERM)
        self.restart_codes.append(self.proc.wait(300))
        self.start()


@dataclass
class Stats:
    counts: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    unavailable_until: float = (
        0.0  # while the server restarts (and a moment after), refused connections are planned
    )
    started_s: list[float] = field(
        default_factory=lambda: [0.0]
    )  # when each server process began serving


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def core_pid(server_pid: int | None) -> int | None:
    """The engine core: the server's child started by multiprocessing's spawn."""
    if server_pid is None:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == server_pid and b"spawn_main" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


async def one_request(
    client: httpx.AsyncClient, args: argparse.Namespace, model: dict, rng: random.Random
) -> str:
    """Send one request of a randomly chosen kind; return its outcome."""
    roll = rng.random()
    max_tokens = rng.randint(8, args.max_tokens)
    body = {
        "model": model["id"],
        "prompt": _text(rng, rng.randint(4, 64)),
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    if roll < args.oversized_fraction:  # far more words than the context holds tokens
        body["prompt"] = _text(rng, 2 * model["max_model_len"])
        resp = await client.post("/v1/completions", json=body)
        return "rejected" if resp.status_code == 400 else _status(resp.status_code, resp.text)
    roll -= args.oversized_fraction
    kind = (
        "disconnect"
        if roll < args.disconnect_fraction
        else ("stall" if roll < args.disconnect_fraction + args.stall_fraction else "full")
    )
    stream = kind != "full" or rng.random() < 0.5
    if not stream:
        resp = await client.post("/v1/completions", json=body)
        return "ok" if resp.status_code == 200 else _status(resp.status_code, resp.text)
    body["stream"] = True
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return _status(resp.status_code, (await resp.aread()).decode(errors="replace"))
        num_events, hang_up_after = 0, rng.randint(1, max(1, max_tokens // 2))
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "ok"
            if '"error"' in line[:20]:
                code = json.loads(line[6:])["error"].get("code")
                return "cut" if code == "server_shutting_down" else f"stream error {code}"
            num_events += 1
            if kind == "disconnect" and num_events >= hang_up_after:
                return "disconnected"
            if kind == "stall":
                await asyncio.sleep(args.stall_seconds)
                return "stalled"
    return "stream ended without [DONE]"


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choices(WORDS, k=num_words))


def _status(code: int, text: str) -> str:
    if code == 503:
        return "refused"  # overloaded or draining: both come with Retry-After
    return f"HTTP {code}: {text[:200]}"


async def worker(
    url: str, args: argparse.Namespace, model: dict, seed: int, stats: Stats, end: float
) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(args.request_timeout)
    ) as client:
        while time.monotonic() < end:
            try:
                outcome = await one_request(client, args, model, rng)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                is_planned = time.monotonic() < stats.unavailable_until
                outcome = "unavailable" if is_planned else f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.5)
            except httpx.TimeoutException:
                outcome = "timeout (hang)"
            stats.counts[outcome if outcome in EXPECTED else "failed"] += 1
            if outcome not in EXPECTED:
                stats.failures.append(outcome)
            if outcome == "refused":
                await asyncio.sleep(0.5)  # as Retry-After asks, roughly


async def sample(server: Server, stats: Stats, started: float, print_line: bool = True) -> dict:
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            metrics = parse_metrics((await client.get(server.url + "/metrics")).text)
    except httpx.HTTPError:
        metrics = {}
    row = {
        "t_s": round(time.monotonic() - started, 1),
        "server_rss_mib": rss_mib(server.pid),
        "core_rss_mib": rss_mib(core_pid(server.pid)),
        "kv_cache_usage": metrics.get("kv_cache_usage"),
        "num_running": metrics.get("num_running"),
        "num_waiting": metrics.get("num_waiting"),
        "generation": len(server.restart_codes),
        **{k: stats.counts[k] for k in (*EXPECTED, "failed")},
    }
    stats.samples.append(row)
    if print_line:
        print(_format(row), flush=True)
    return row


def _format(row: dict) -> str:
    def mib(value: float | None) -> str:
        return "     -" if value is None else f"{value:6.0f}"

    kv = "   -" if row["kv_cache_usage"] is None else f"{100 * row['kv_cache_usage']:4.1f}"
    counts = " ".join(f"{k} {row[k]}" for k in (*EXPECTED, "failed") if row[k])
    return (
        f"t={row['t_s']:6.0f}s  RSS MiB server {mib(row['server_rss_mib'])} core {mib(row['core_rss_mib'])}  "
        f"kv {kv}%  running {row['num_running']} waiting {row['num_waiting']}  | {counts}"
    )


async def monitor(
    server: Server, args: argparse.Namespace, stats: Stats, started: float, end: float
) -> None:
    restart_at = started + args.restart_at * args.minutes * 60 if args.restart_at else None
    while time.monotonic() < end:
        await asyncio.sleep(args.interval)
        if restart_at is not None and time.monotonic() >= restart_at:
            restart_at = None
            print("SIGTERM to the server (drain), then restart", flush=True)
            stats.unavailable_until = float("inf")
            await asyncio.to_thread(server.restart)
            stats.unavailable_until = time.monotonic() + 2.0
            stats.started_s.append(time.monotonic() - started)
            print(
                f"restarted; the drained server exited with {server.restart_codes[-1]}", flush=True
            )
        await sample(server, stats, started)


async def wait_idle(server: Server, stats: Stats, started: float, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        row = await sample(server, stats, started, print_line=False)
        if (row["kv_cache_usage"], row["num_running"], row["num_waiting"]) == (
            0,
            0,
            0,
        ) or time.monotonic() > deadline:
            print(_format(row) + "  (after the load)", flush=True)
            return row


def verdict(server: Server, stats: Stats, args: argparse.Namespace, final: dict) -> list[str]:
    """Reasons the run failed (empty: it passed)."""
    problems = [f"{n} x {text}" for text, n in collections.Counter(stats.failures).most_common(10)]
    if (final["kv_cache_usage"], final["num_running"], final["num_waiting"]) != (0, 0, 0):
        problems.append(
            f"not idle after the load: kv {final['kv_cache_usage']}, running {final['num_running']}, "
            f"waiting {final['num_waiting']}"
        )
    problems += [
        f"the drained server exited with {code}, not 0"
        for code in server.restart_codes
        if code != 0
    ]
    generation = final[
        "generation"
    ]  # RSS is compared within the last server process, after its warm-up
    warm_s = stats.started_s[generation] + args.warmup
    rows = [r for r in stats.samples if r["generation"] == generation and r["t_s"] >= warm_s]
    rows = rows or [r for r in stats.samples if r["generation"] == generation]
    for key in ("server_rss_mib", "core_rss_mib"):
        values = [r[key] for r in rows if r[key] is not None]
        if len(values) >= 2:
            growth = values[-1] - values[0]
            print(
                f"{key}: {values[0]:.0f} after warm-up -> {values[-1]:.0f} at the end "
                f"(max {max(values):.0f}), growth {growth:+.0f} MiB"
            )
            if growth > args.max_rss_growth_mib:
                problems.append(
                    f"{key} grew by {growth:.0f} MiB (> --max-rss-growth-mib {args.max_rss_growth_mib})"
                )
    return problems


async def run(args: argparse.Namespace, server: Server) -> int:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        model = (await client.get("/v1/models")).json()["data"][0]
    stats = Stats()
    started = time.monotonic()
    end = started + args.minutes * 60
    print(
        f"soak: {args.minutes} min against {server.url} ({model['id']}, context {model['max_model_len']}), "
        f"{args.concurrency} workers",
        flush=True,
    )
    await sample(server, stats, started)
    workers = [
        worker(server.url, args, model, args.seed + i, stats, end) for i in range(args.concurrency)
    ]
    await asyncio.gather(monitor(server, args, stats, started, end), *workers)
    final = await wait_idle(server, stats, started, args.idle_timeout)
    print("requests: " + ", ".join(f"{k} {stats.counts[k]}" for k in (*EXPECTED, "failed")))
    problems = verdict(server, stats, args, final)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"samples": stats.samples, "counts": dict(stats.counts), "problems": problems},
                indent=1,
            )
        )
    print("FAIL:\n  " + "\n  ".join(problems) if problems else "PASS", flush=True)
    return 1 if problems else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0]
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--model", help="start `kvserve serve --model MODEL` (extra flags: --server-arg)"
    )
    target.add_argument("--url", help="soak a running server instead")
    p.add_argument("--server-pid", type=int, help="with --url: the server's pid, for RSS figures")
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra `kvserve serve` flag (repeatable)"
    )
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--max-tokens", type=int, default=128, help="output tokens per request: uniform in 8..N"
    )
    p.add_argument("--disconnect-fraction", type=float, default=0.3)
    p.add_argument("--stall-fraction", type=float, default=0.05)
    p.add_argument("--stall-seconds", type=float, default=10.0)
    p.add_argument("--oversized-fraction", type=float, default=0.05)
    p.add_argument(
        "--restart-at",
        type=float,
        default=None,
        help="SIGTERM + restart at this fraction of the run",
    )
    p.add_argument("--interval", type=float, default=5.0, help="seconds between sample lines")
    p.add_argument(
        "--warmup",
        type=float,
        default=10.0,
        help="seconds after a server (re)start before its RSS baseline is taken",
    )
    p.add_argument("--max-rss-growth-mib", type=float, default=100.0)
    p.add_argument(
        "--request-timeout", type=float, default=120.0, help="a request slower than this is a hang"
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        help="how long to wait for the server to go idle",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the samples and the verdict to this file")
    args = p.parse_args(argv)
    for name in ("disconnect_fraction", "stall_fraction", "oversized_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if args.disconnect_fraction + args.stall_fraction + args.oversized_fraction > 1:
        p.error("the disconnect, stall and oversized fractions add up to more than 1")
    if args.restart_at is not None and (args.url or not 0 < args.restart_at < 1):
        p.error(
            f"--restart-at needs --model (an own server) and a fraction in (0, 1), got {args.restart_at}"
        )
    if args.minutes <= 0 or args.concurrency < 1 or args.max_tokens < 8:
        p.error("--minutes must be > 0, --concurrency >= 1 and --max-tokens >= 8")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url:
        return asyncio.run(run(args, Server(url=args.url.rstrip("/"), pid=args.server_pid)))
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="kvserve-soak-", suffix=".log")[1])
    cmd = [
        sys.executable,
        "-m",
        "kvserve.server.cli",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        *args.server_arg,
    ]
    server = Server(url=f"http://127.0.0.1:{port}", cmd=cmd, log_path=log_path)
    print(f"server log: {log_path}", flush=True)
    server.start()
    try:
        return asyncio.run(run(args, server))
    finally:
        stop(server.proc)


if __name__ == "__main__":
    sys.exit(main())
