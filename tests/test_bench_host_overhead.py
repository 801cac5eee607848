"""Smoke test of the host-overhead benchmark: the real engine loop over a stub forward, a few steps
per batch size (it prints microseconds; nothing here checks them)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_host_overhead
from checkpoints import tiny_smollm


def test_bench_host_overhead_times_every_phase_of_decode_and_mixed_steps(tmp_path, capsys):
    model_dir = tiny_smollm(tmp_path / "model")
    out = tmp_path / "host.json"
    argv = [
        "--model-dir",
        str(model_dir),
        "--batch-sizes",
        "1,5",
        "--steps",
        "6",
        "--stream-mib",
        "1",
    ]
    assert (
        bench_host_overhead.main(
            [*argv, "--mixed-every", "2", "--mixed-prompt", "40", "--out", str(out)]
        )
        == 0
    )
    results = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["kind"]) for r in results] == [
        (1, "decode"),
        (1, "mixed"),
        (5, "decode"),
        (5, "mixed"),
    ]
    for r in results:
        assert r["total"] > 0 and all(
            r[phase] >= 0 for phase in ("schedule", "inputs", "sampler", "outputs")
        )
    printed = capsys.readouterr().out
    assert "schedule" in printed and "mixed" in printed


@pytest.mark.parametrize(
    "bad",
    [["--batch-sizes", "1,x"], ["--steps", "0"], ["--mixed-every", "-1"], ["--stream-mib", "-2"]],
)
def test_bench_host_overhead_refuses_bad_arguments(bad):
    with pytest.raises(SystemExit) as exc:
        bench_host_overhead.main(bad)
    assert exc.value.code == 2
