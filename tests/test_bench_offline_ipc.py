"""Smoke tests of the serving-reference and IPC benchmarks (they print speeds; nothing here checks them)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_ipc, bench_offline
from checkpoints import tiny_smollm


def test_bench_offline_reports_each_batch_size(tmp_path, capsys):
    model_dir = tiny_smollm(tmp_path / "model")
    out = tmp_path / "offline.json"
    argv = [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--batch-sizes",
        "1,3",
        "--repeats",
        "2",
        "--out",
        str(out),
    ]
    assert bench_offline.main(argv) == 0
    printed = capsys.readouterr().out
    assert "batch    1:" in printed and "decode" in printed and "batch    3:" in printed
    result = json.loads(out.read_text())
    assert [row["batch_size"] for row in result["summary"]] == [1, 3]
    assert "tpot_ms" in result["summary"][0] and len(result["runs"]["3"]) == 2


def test_bench_offline_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit):
        bench_offline.main(["--model", "x", "--batch-sizes", "0"])
    assert "must be positive" in capsys.readouterr().err


def test_bench_ipc_runs(capsys):
    assert bench_ipc.main(["--iters", "3"]) == 0
    printed = capsys.readouterr().out
    assert "msgpack  B= 64" in printed and "multiprocessing pipe round trip" in printed
