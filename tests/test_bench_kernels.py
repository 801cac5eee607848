"""Smoke test of the kernel micro-benchmark script (it prints timings; nothing here checks them)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_kernels
from kvserve.models import cpu_ops


@pytest.mark.skipif(
    not cpu_ops.load() or not cpu_ops.has_fast_bf16(), reason="no CPU kernel set runs here"
)
def test_bench_kernels_runs_and_reports_each_measurement(monkeypatch, capsys):
    monkeypatch.setattr(bench_kernels, "LAYERS", 2)
    assert (
        bench_kernels.main(
            ["--rows", "3", "--contexts", "40", "--threads", str(torch.get_num_threads())]
        )
        == 0
    )
    out = capsys.readouterr().out
    for name in ("qkv", "o", "gate_up", "down", "lm_head"):
        assert f"linear {name}" in out
    assert "decode attention batch 64 context 40" in out
