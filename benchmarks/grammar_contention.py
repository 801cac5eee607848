"""How much a large grammar compile slows a concurrent stream, for two source trees side by side.

For each tree (e.g. a base commit unpacked with `git archive` and this checkout), alternating,
`--rounds` times: start a server on the SmolLM-shaped random checkpoint, start one streaming
completion (ignore_eos, `--stream-tokens` tokens), and once it streams, send the big request
(chat, `--tools` tools with realistic parameter schemas, tool_choice "required", tool names
unique per round so nothing is cached). Reports the stream's inter-token gaps while the big
request runs (median, p99, worst), the big request's status and time, and the largest
`kvserve:num_requests_compiling` seen on /metrics (sampled every 0.1 s).

    python -m benchmarks.smollm_checkpoint  # or build_smollm_like(...) as in docs/structured_outputs.md
    git archive 393ee78 | tar -x -C /tmp/base
    python benchmarks/grammar_contention.py --tree base=/tmp/base --tree new=. --tools 128 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import httpx

MODEL = "loadtest_out/models/smollm-135m-random"


def tool(name: str) -> dict:
    """A realistic function: strings, an enum, a bounded integer, an array, a nested object."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"Run {name} for the user.",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["query", "unit"],
                "properties": {
                    "query": {"type": "string", "description": "what to look up"},
                    "unit": {"type": "string", "enum": ["metric", "imperial", "kelvin"]},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                    "filter": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["field"],
                        "properties": {"field": {"type": "string"}, "value": {"type": "number"}},
                    },
                },
            },
        },
    }


def start_server(
    tree: str, model: str, port: int, extra: list[str]
) -> tuple[subprocess.Popen, str]:
    log = tempfile.NamedTemporaryFile("w+", prefix="grammar-bench-", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "kvserve.server.cli",
        "serve",
        "--model",
        os.path.abspath(model),
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--log-level",
        "warning",
        *extra,
    ]
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {open(log.name).read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not start")


def compiling_gauge(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("kvserve:num_requests_compiling{"):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def one_round(url: str, num_tools: int, stream_tokens: int) -> dict:
    times: list[float] = []
    started, done = threading.Event(), threading.Event()

    def stream() -> None:  # until the big request is done (closing it aborts the rest)
        body = {
            "prompt": "Once upon a time",
            "max_tokens": stream_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())
                    if len(times) == 20:
                        started.set()
                if done.is_set():
                    break

    streamer = threading.Thread(target=stream)
    streamer.start()
    started.wait(60)
    time.sleep(2.0)  # quiet seconds for the baseline gaps
    tag = uuid.uuid4().hex[:8]
    tools = [tool(f"fn_{tag}_{i}") for i in range(num_tools)]
    body = {
        "messages": [{"role": "user", "content": "Call a tool."}],
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 32,
    }
    result: dict = {}
    gauge = []

    def big() -> None:
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        result.update(
            status=r.status_code, seconds=time.monotonic() - t0, start=t0, end=time.monotonic()
        )

    sender = threading.Thread(target=big)
    sender.start()
    while sender.is_alive():
        gauge.append(compiling_gauge(url))
        time.sleep(0.1)
    time.sleep(0.5)
    done.set()
    streamer.join()
    before = [
        b - a for a, b in zip(times, times[1:]) if result["start"] - 2.0 < b < result["start"]
    ]
    during = [
        b - a for a, b in zip(times, times[1:]) if result["start"] <= b <= result["end"] + 0.2
    ]
    return {
        "status": result["status"],
        "request_s": result["seconds"],
        "max_compiling_gauge": max(gauge),
        "gap_ms_before_median": 1000 * statistics.median(before) if before else None,
        "gap_ms_during_median": 1000 * statistics.median(during) if during else None,
        "gap_ms_during_p99": 1000 * sorted(during)[int(0.99 * (len(during) - 1))]
        if during
        else None,
        "gap_ms_during_max": 1000 * max(during) if during else None,
        "num_gaps_during": len(during),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--tools", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stream-tokens", type=int, default=1900)
    parser.add_argument(
        "--server-arg", action="append", default=[], help="NAME=ARG: extra flag for one tree"
    )
    parser.add_argument("--port", type=int, default=8471)
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    extra: dict[str, list[str]] = {}
    for item in args.server_arg:
        name, flag = item.split("=", 1)
        extra.setdefault(name, []).extend(flag.split())
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()}", flush=True)
    for rnd in range(args.rounds):
        for name, path in trees.items():
            proc, url = start_server(path, args.model, args.port, extra.get(name, []))
            try:
                row = one_round(url, args.tools, args.stream_tokens)
            finally:
                proc.terminate()
                proc.wait(30)
            print(
                json.dumps(
                    {
                        "round": rnd,
                        "tree": name,
                        "tools": args.tools,
                        **{k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()},
                        "load": round(os.getloadavg()[0], 2),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
