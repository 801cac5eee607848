"""Start-up phase timing: `with phase("weights"):` charges its wall time to the active `PhaseTimer`.

Code deep in the loader marks its phases without being handed a timer; with none active
(tests, tools) `phase` costs nothing. Times are exclusive: a phase nested in another is
charged to itself only, so the phases and "other" add up to the total.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_active: ContextVar[PhaseTimer | None] = ContextVar("kvserve_phase_timer", default=None)


class PhaseTimer:
    """Seconds per phase name, in the order they first start, while `active()`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()
        self._stack: list[list[float]] = []  # [start, seconds spent in nested phases]

    @contextmanager
    def active(self) -> Iterator[PhaseTimer]:
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)

    @property
    def total(self) -> float:
        return time.perf_counter() - self._start

    def summary(self) -> str:
        """'1.84 s: config 0.21, model 0.62, ..., other 0.03' (phases under 5 ms are left out)."""
        total = self.total
        parts = [f"{name} {sec:.2f}" for name, sec in self.seconds.items() if sec >= 0.005]
        parts.append(f"other {max(0.0, total - sum(self.seconds.values())):.2f}")
        return f"{total:.2f} s: " + ", ".join(parts)


@contextmanager
def phase(name: str) -> Iterator[None]:
    timer = _active.get()
    if timer is None:
        yield
        return
    timer.seconds.setdefault(name, 0.0)  # listed in the order phases start
    frame = [time.perf_counter(), 0.0]
    timer._stack.append(frame)
    try:
        yield
    finally:
        timer._stack.pop()
        elapsed = time.perf_counter() - frame[0]
        timer.seconds[name] += elapsed - frame[1]
        if timer._stack:
            timer._stack[-1][1] += elapsed


def process_uptime() -> float | None:
    """Seconds since this process started (Linux; else None): what start-up spent before the engine."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
