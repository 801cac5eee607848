"""Start a server subprocess, wait until it is healthy, and always stop it.

Used by run_suite.py and the end-to-end tests. The server gets its own process
group so that stopping it also stops any workers it spawned, and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, num_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return ""


def wait_healthy(base_url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Poll GET /health until 200; raise with the log's tail if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout_s:.0f} s:\n{_tail(log_path)}")


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the server's process group, then SIGKILL it after `grace_s`."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def running_server(
    cmd: list[str], port: int, log_path: Path, timeout_s: float = 300.0, env: dict | None = None
) -> Iterator[str]:
    """Run `cmd` (which must listen on `port`) and yield its base URL once healthy."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, proc, log_path, timeout_s)
        yield base_url
    finally:
        stop(proc)
