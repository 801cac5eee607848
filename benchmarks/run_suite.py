"""The standard benchmark suite: kvserve vs a one-request-at-a-time baseline.

`python -m benchmarks.run_suite [--quick]`

1. Builds (once) a random SmolLM-135M-shaped checkpoint (see smollm_checkpoint.py).
2. For each server (kvserve via `python -m kvserve.server.cli serve`, then
   benchmarks/baseline_server.py), starts it on a free loopback port and runs:
   a concurrency sweep (1, 4, 16, 64; rate inf), a Poisson rate sweep, and one
   prefix-repetition point (prefix-cache behaviour). Both servers get exactly the
   same prompts (token ids from the checkpoint's tokenizer, same seed).
3. Writes OUT/suite.md (tables) and OUT/suite.json; every point's result.json and
   plots are under OUT/<server>/<sweep>/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.procs import free_port, running_server
from benchmarks.smollm_checkpoint import build_smollm_like
from kvserve.loadtest import cli
from kvserve.loadtest.report import dump_json, fmt_number, markdown_table


@dataclass(frozen=True, slots=True)
class SuiteSize:
    input_len: int
    output_len: int
    num_prompts: int  # per sweep point
    concurrencies: tuple[int, ...]
    rates: tuple[float, ...]
    prefix_len: int


FULL = SuiteSize(256, 128, 64, (1, 4, 16, 64), (0.5, 1.0, 2.0, 4.0, 8.0), 512)
# Quick: 16 requests per point, so a cap of 64 would equal 16; it is left out.
QUICK = SuiteSize(32, 16, 16, (1, 4, 16), (1.0, 4.0), 64)


def sweeps(size: SuiteSize) -> dict[str, list[str]]:
    """Sweep name -> `loadtest serve` options (besides URL, output and tokenizer)."""
    common = [
        "--input-len",
        str(size.input_len),
        "--output-len",
        str(size.output_len),
        "--num-prompts",
        str(size.num_prompts),
    ]
    return {
        "concurrency": common
        + ["--request-rate", "inf", "--max-concurrency", *map(str, size.concurrencies)],
        "rate": common + ["--request-rate", *map(str, size.rates)],
        "prefix": common
        + [
            "--dataset",
            "prefix-repetition",
            "--prefix-len",
            str(size.prefix_len),
            "--max-concurrency",
            "4",
        ],
    }


def server_commands(args: argparse.Namespace, model_dir: Path, port: int) -> dict[str, list[str]]:
    common = ["--model", str(model_dir), "--port", str(port), "--dtype", args.dtype]
    default_kvserve = [sys.executable, "-m", "kvserve.server.cli", "serve"]
    kvserve = shlex.split(args.kvserve_cmd) if args.kvserve_cmd else default_kvserve
    cmds = {}
    if not args.skip_kvserve:
        cmds["kvserve"] = kvserve + common + shlex.split(args.kvserve_args)
    if not args.skip_baseline:
        cmds["baseline"] = [sys.executable, "-m", "benchmarks.baseline_server"] + common
    return cmds


def kvserve_available() -> bool:
    return importlib.util.find_spec("kvserve.server.cli") is not None


def run_server_suite(
    name: str,
    cmd: list[str],
    port: int,
    size: SuiteSize,
    model_dir: Path,
    out: Path,
    startup_timeout_s: float,
) -> dict[str, list[dict]]:
    """Start one server, run every sweep against it; returns sweep -> points."""
    print(f"\n### {name}: {shlex.join(cmd)}", flush=True)
    results: dict[str, list[dict]] = {}
    with running_server(cmd, port, out / name / "server.log", startup_timeout_s) as base_url:
        # one server serves every sweep: a seed per sweep keeps a later sweep's prompts from
        # hitting the prefix cache that an earlier sweep's identical prompts filled
        for sweep_idx, (sweep, options) in enumerate(sweeps(size).items()):
            sweep_out = out / name / sweep
            argv = [
                "serve",
                "--base-url",
                base_url,
                "--tokenizer",
                str(model_dir),
                "--out",
                str(sweep_out),
                "--seed",
                str(1000 * sweep_idx),
                *options,
            ]
            print(f"--- {name} / {sweep}: loadtest {shlex.join(argv)}", flush=True)
            if cli.main(argv) != 0:
                print(f"warning: {name} / {sweep} did not complete cleanly", file=sys.stderr)
            results[sweep] = _load_points(sweep_out)
    return results


def _load_points(sweep_out: Path) -> list[dict]:
    if (sweep_out / "sweep.json").exists():
        return json.loads((sweep_out / "sweep.json").read_text())
    if (sweep_out / "result.json").exists():  # a single-point sweep
        doc = json.loads((sweep_out / "result.json").read_text())
        label = cli.point_label(
            float(doc["config"]["request_rate"]), doc["config"]["max_concurrency"]
        )
        return [{"label": label, "summary": doc["summary"], "server": doc["server_metrics"]}]
    return []


def comparison_table(results: dict[str, dict[str, list[dict]]], sweep: str) -> str:
    """kvserve vs baseline side by side for one sweep (same labels = same load)."""
    if not {"kvserve", "baseline"} <= results.keys():
        return ""
    base = {p["label"]: p["summary"] for p in results["baseline"].get(sweep, [])}
    rows = [
        "| load | kvserve out tok/s | baseline out tok/s | speedup | kvserve TTFT p50 (ms) "
        "| baseline TTFT p50 (ms) | kvserve E2E p50 (ms) | baseline E2E p50 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in results["kvserve"].get(sweep, []):
        k, b = p["summary"], base.get(p["label"])
        if b is None:
            continue
        speedup = (
            k["output_throughput"] / b["output_throughput"] if b["output_throughput"] else None
        )
        cells = [
            fmt_number(k["output_throughput"], 1),
            fmt_number(b["output_throughput"], 1),
            fmt_number(speedup) + "x",
            fmt_number(k["ttft"]["p50_ms"], 1),
            fmt_number(b["ttft"]["p50_ms"], 1),
            fmt_number(k["e2el"]["p50_ms"], 1),
            fmt_number(b["e2el"]["p50_ms"], 1),
        ]
        rows.append(f"| {p['label']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write_report(
    out: Path,
    args: argparse.Namespace,
    size: SuiteSize,
    commands: dict,
    results: dict,
    notes: list[str],
) -> str:
    lines = [
        f"# kvserve benchmark suite ({'quick' if args.quick else 'full'})",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        f"- model: random SmolLM-135M-shaped Llama at {args.model_dir} (--dtype {args.dtype})",
        f"- load: input {size.input_len} tokens, output {size.output_len} tokens (ignore_eos), "
        f"{size.num_prompts} requests per point",
        f"- command: `python -m benchmarks.run_suite {shlex.join(sys.argv[1:])}`",
        *[f"- {name} server: `{shlex.join(cmd)}`" for name, cmd in commands.items()],
        *[f"- note: {n}" for n in notes],
    ]
    for sweep in sweeps(size):
        lines += ["", f"## {sweep} sweep"]
        if table := comparison_table(results, sweep):
            lines += ["", table]
        for name, per_sweep in results.items():
            if per_sweep.get(sweep):
                lines += ["", f"**{name}**", "", markdown_table(per_sweep[sweep])]
    text = "\n".join(lines) + "\n"
    (out / "suite.md").write_text(text)
    dump_json(out / "suite.json", results)
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run_suite", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--quick", action="store_true", help="small lengths and counts (minutes on 2 CPU cores)"
    )
    p.add_argument(
        "--model-dir",
        default="loadtest_out/models/smollm-135m-random",
        help="checkpoint folder; built there if missing",
    )
    p.add_argument("--out", help="output folder (default loadtest_out/suite-<timestamp>)")
    p.add_argument("--dtype", default="bfloat16", help="passed to both servers")
    p.add_argument("--skip-kvserve", action="store_true")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument(
        "--kvserve-cmd",
        help="command that starts kvserve (default: python -m kvserve.server.cli serve)",
    )
    p.add_argument(
        "--kvserve-args", default="", help="extra kvserve flags, e.g. '--max-num-seqs 64'"
    )
    p.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for /health"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    size = QUICK if args.quick else FULL
    out = Path(args.out or f"loadtest_out/suite-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    notes = []
    if not args.skip_kvserve and not args.kvserve_cmd and not kvserve_available():
        notes.append("kvserve skipped: `server.cli` is not importable")
        args.skip_kvserve = True
    model_dir = build_smollm_like(args.model_dir)
    port = free_port()
    commands = server_commands(args, model_dir, port)
    results: dict[str, dict[str, list[dict]]] = {}
    for name, cmd in commands.items():
        try:  # one port for both: they run one after the other
            results[name] = run_server_suite(
                name, cmd, port, size, model_dir, out, args.startup_timeout
            )
        except (RuntimeError, TimeoutError) as exc:
            notes.append(f"{name} failed to run: {str(exc).splitlines()[0]}")
            print(f"error: {name}: {exc}", file=sys.stderr)
    print(write_report(out, args, size, commands, results, notes))
    print(f"suite results in {out}")
    return 0 if results and all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
