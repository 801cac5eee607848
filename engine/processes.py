"""Stopping child processes (the engine core, tensor-parallel workers) without leaving any behind."""

from __future__ import annotations

import time
from multiprocessing.process import BaseProcess


def wait_for_exit(process: BaseProcess, timeout_s: float) -> None:
    """Join `process`; terminate, then kill it if it does not exit in time."""
    deadline = time.monotonic() + timeout_s
    process.join(max(0.0, deadline - time.monotonic()))
    if process.is_alive():
        process.terminate()
        process.join(2.0)
    if process.is_alive():
        process.kill()
        process.join(2.0)
