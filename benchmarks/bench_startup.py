"""Start-up time: `kvserve serve` launched to its first `GET /health` 200, repeated.

    python -m benchmarks.bench_startup [--model PATH] [--repeats 3] [--offline] [--out startup.json] \\
        [-- extra kvserve serve flags]

Each repeat starts `python -m kvserve.server.cli serve` on a free port, polls /health every 20 ms,
and stops the server (its whole process group) once it answers 200; the server's log goes
to a temp file whose tail is shown if it fails. No `--model` means the built-in default
model. `--offline` also times `LLMEngine(EngineArgs(model=...))` in a fresh interpreter
(imports included) and prints the engine's own phase log line. Prints the times and their
median, and writes them as JSON with `--out`. Timing runs belong on an idle machine:
other processes on the same cores show up directly in these figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.procs import _tail, free_port, stop

_OFFLINE_CHILD = """
import json, logging, sys, time
start = time.perf_counter()
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
from kvserve.engine import EngineArgs, LLMEngine
imported = time.perf_counter()
LLMEngine(EngineArgs(**json.loads(sys.argv[1])))
done = time.perf_counter()
print(json.dumps({"import_s": imported - start, "engine_s": done - imported}))
"""


def serve_command(model: str | None, port: int, extra: list[str]) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "kvserve.server.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return cmd + (["--model", model] if model else []) + extra


def time_to_healthy(cmd: list[str], port: int, log_path: Path, timeout_s: float) -> float:
    """Seconds from launching `cmd` to its first /health 200; the server is stopped afterwards."""
    with open(log_path, "wb") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/health"
    try:
        with httpx.Client(timeout=1.0) as client:
            while time.perf_counter() - start < timeout_s:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}:\n{_tail(log_path)}")
                try:
                    if client.get(url).status_code == 200:
                        return time.perf_counter() - start
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
        raise TimeoutError(f"server not healthy after {timeout_s:.0f} s:\n{_tail(log_path)}")
    finally:
        stop(proc)


def time_offline(model: str | None) -> dict:
    """`LLMEngine` construction in a fresh interpreter: wall, import and engine seconds, phase line."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _OFFLINE_CHILD, json.dumps({"model": model})],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"offline engine start failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    phases = [line for line in proc.stderr.splitlines() if line.startswith("engine start-up")]
    return {"wall_s": wall, **result, "phases": phases[-1] if phases else None}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="checkpoint directory (default: the built-in model)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for one start"
    )
    parser.add_argument("--offline", action="store_true", help="also time LLMEngine construction")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    serve_s = []
    with tempfile.TemporaryDirectory(prefix="kvserve-startup-") as tmp:
        for i in range(args.repeats):
            port = free_port()
            seconds = time_to_healthy(
                serve_command(args.model, port, extra),
                port,
                Path(tmp) / f"serve-{i}.log",
                args.timeout,
            )
            serve_s.append(seconds)
            print(
                f"serve start-up {i + 1}/{args.repeats}: {seconds:.2f} s to /health 200", flush=True
            )
    results: dict = {
        "model": args.model,
        "serve_flags": extra,
        "serve_s": serve_s,
        "serve_median_s": statistics.median(serve_s),
    }
    print(f"median of {args.repeats}: {results['serve_median_s']:.2f} s")
    if args.offline:
        offline = [time_offline(args.model) for _ in range(args.repeats)]
        for i, run in enumerate(offline):
            print(
                f"LLMEngine {i + 1}/{args.repeats}: {run['wall_s']:.2f} s in a fresh interpreter "
                f"(imports {run['import_s']:.2f}, engine {run['engine_s']:.2f}): {run['phases']}"
            )
        results["offline"] = offline
        results["offline_median_s"] = statistics.median(run["wall_s"] for run in offline)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
