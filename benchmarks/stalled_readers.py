"""Clients that stop reading: the server process's RSS and running requests over time.

Starts `kvserve serve` (extra flags after `--`), opens `--streams` raw connections with a
4 KiB receive buffer that each request a long streamed completion (n=8, logprobs=20) and
never read, then every 10 s prints the server process's RSS and `num_requests_running`.
At the end it checks that a new request is answered and counts the stall aborts logged.
Not part of the test suite.

    python -m benchmarks.stalled_readers --model CKPT --duration 90 -- --stream-idle-timeout 60
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.slowloris import _free_port

REPO = Path(__file__).resolve().parent.parent


def _rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    return 0


def _num_running(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("kvserve:num_requests_running"):
            return float(line.split()[-1])
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=90.0)
    parser.add_argument("server_args", nargs="*", help="extra `kvserve serve` flags (after --)")
    args = parser.parse_args(argv)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tempfile.mktemp(prefix="stalled-readers-", suffix=".log")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve.server.cli",
            "serve",
            "--model",
            args.model,
            "--port",
            str(port),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            *args.server_args,
        ],
        cwd=REPO,
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start; see {log_path}") from None
                time.sleep(0.3)
        print(f"before: rss={_rss_mib(proc.pid)} MiB", flush=True)
        body = json.dumps(
            {
                "prompt": "Once upon a time",
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "stream": True,
                "logprobs": 20,
                "n": 8,
            }
        ).encode()
        socks = []
        for _ in range(args.streams):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            socks.append(sock)
        start = time.monotonic()
        peak = 0
        next_print = 0.0
        while (elapsed := time.monotonic() - start) < args.duration:
            peak = max(peak, _rss_mib(proc.pid))
            if elapsed >= next_print:
                print(
                    f"t={elapsed:.0f}s rss={_rss_mib(proc.pid)} MiB running={_num_running(url):.0f}",
                    flush=True,
                )
                next_print += 10
            time.sleep(1)
        status = httpx.post(
            url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60
        ).status_code
        print(
            f"peak rss={peak} MiB, after={_rss_mib(proc.pid)} MiB; a new request: {status}",
            flush=True,
        )
    finally:
        proc.terminate()
        proc.wait(30)
    num_aborts = Path(log_path).read_text(errors="replace").count("(--stream-idle-timeout)")
    print(f"{num_aborts} stalled connections aborted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
