"""Slowloris against `kvserve serve` under a low open-file limit: is the server still answering?

Starts `kvserve serve` with `ulimit -n LIMIT`, keeps `--sockets` connections open that each send
a partial request header and then one more header line every second (reconnecting any the
server closes), and meanwhile asks `/health` twice a second with a short timeout. Prints, per
mode, how many health checks succeeded, their latency, the server's open fds, and how many
bytes of log it wrote. Not part of the test suite.

    python -m benchmarks.slowloris --model CKPT --sockets 1100 --nofile 1024 --duration 30 \
        --mode defaults --mode no-limits --mode limit-concurrency

Modes: `defaults` (kvserve's --header-timeout and --max-connections), `no-limits` (both off:
the behaviour before they existed), `limit-concurrency` (both off, uvicorn's limit_concurrency
set to the cap `defaults` would use instead).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
_LAUNCH_LIMIT_CONCURRENCY = """
import sys, uvicorn, server.cli as cli
from kvserve.server.connections import default_max_connections
_orig = cli.uvicorn_config
def patched(app, config):
    uv = _orig(app, config)
    uv.limit_concurrency = default_max_connections()
    return uv
cli.uvicorn_config = patched
sys.exit(cli.main(sys.argv[1:]))
"""
MODES = {
    "defaults": ([], None),
    "no-limits": (["--header-timeout", "0", "--max-connections", "1000000"], None),
    "limit-concurrency": (
        ["--header-timeout", "0", "--max-connections", "1000000"],
        _LAUNCH_LIMIT_CONCURRENCY,
    ),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(model: str, port: int, nofile: int, mode: str, log_path: str) -> subprocess.Popen:
    flags, launcher = MODES[mode]
    args = [
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        *flags,
    ]
    cmd = (
        [sys.executable, "-c", launcher, *args]
        if launcher
        else [sys.executable, "-m", "kvserve.server.cli", *args]
    )

    def limit_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    log = open(log_path, "wb")
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit_fds
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not start; see {log_path}")


def _slow_socket(port: int) -> socket.socket | None:
    sock = socket.socket()
    sock.setblocking(False)
    try:
        sock.connect(("127.0.0.1", port))
    except BlockingIOError:
        pass
    except OSError:
        sock.close()
        return None
    return sock


def run_mode(
    model: str, mode: str, num_sockets: int, nofile: int, duration_s: float
) -> dict[str, float]:
    port = _free_port()
    log_path = tempfile.mktemp(prefix=f"slowloris-{mode}-", suffix=".log")
    proc = _start(model, port, nofile, mode, log_path)
    log_start = os.path.getsize(log_path)
    socks: list[socket.socket] = []
    started: set[int] = set()  # id() of sockets that sent their request line
    latencies: list[float] = []
    num_checks = num_ok = 0
    max_fds = 0
    end = time.monotonic() + duration_s
    next_trickle = 0.0
    try:
        while time.monotonic() < end:
            socks = [s for s in socks if s.fileno() != -1]
            started &= {id(s) for s in socks}
            while len(socks) < num_sockets and (sock := _slow_socket(port)) is not None:
                socks.append(sock)
            if time.monotonic() >= next_trickle:
                next_trickle = time.monotonic() + 1.0
                for sock in socks:
                    try:
                        sock.send(
                            b"X-Slow: 1\r\n"
                            if id(sock) in started
                            else b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                        )
                        started.add(id(sock))
                    except OSError:
                        sock.close()
            start = time.monotonic()
            num_checks += 1
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    num_ok += 1
                    latencies.append(time.monotonic() - start)
            except httpx.HTTPError:
                pass
            max_fds = max(max_fds, len(os.listdir(f"/proc/{proc.pid}/fd")))
            time.sleep(max(0.0, 0.5 - (time.monotonic() - start)))
    finally:
        for sock in socks:
            sock.close()
        proc.terminate()
        proc.wait(30)
    return {
        "checks": num_checks,
        "ok": num_ok,
        "median_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
        "max_ms": 1000 * max(latencies) if latencies else float("nan"),
        "max_server_fds": max_fds,
        "log_bytes": os.path.getsize(log_path) - log_start,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--sockets", type=int, default=1100)
    parser.add_argument("--nofile", type=int, default=1024)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--mode", action="append", choices=sorted(MODES))
    args = parser.parse_args(argv)
    for mode in args.mode or ["defaults"]:
        result = run_mode(args.model, mode, args.sockets, args.nofile, args.duration)
        print(
            f"{mode:18s} "
            + " ".join(
                f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
