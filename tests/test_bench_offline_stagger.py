"""bench_offline --arrival-gap-ms (requests trickling in, as served) and step_trace --warm-up:
smoke tests; nothing checks a speed."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_offline, step_trace
from checkpoints import tiny_smollm


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(tiny_smollm(tmp_path_factory.mktemp("stagger") / "model"))


def test_bench_offline_staggered_arrivals(tiny_model, tmp_path, capsys):
    out = tmp_path / "offline.json"
    argv = [
        "--model",
        tiny_model,
        "--dtype",
        "float32",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--batch-sizes",
        "1,3",
        "--repeats",
        "1",
        "--arrival-gap-ms",
        "2",
        "--out",
        str(out),
    ]
    assert bench_offline.main(argv) == 0
    assert "batch    3:" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["args"]["arrival_gap_ms"] == 2 and "tpot_ms" in result["summary"][0]


def test_bench_offline_rejects_negative_gap(capsys):
    with pytest.raises(SystemExit):
        bench_offline.main(["--model", "x", "--arrival-gap-ms", "-1"])
    assert "--arrival-gap-ms must be >= 0, got -1" in capsys.readouterr().err


def test_step_trace_with_warm_up(tiny_model, capsys):
    argv = [
        "--model",
        tiny_model,
        "--dtype",
        "float32",
        "--requests",
        "3",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--rounds",
        "1",
        "--warm-up",
    ]
    assert step_trace.main(argv) == 0
    printed = capsys.readouterr().out
    assert "warm-up step" in printed and "round 1:" in printed
