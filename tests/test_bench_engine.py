"""Smoke test of the offline engine-vs-transformers benchmark (it prints speeds; nothing here checks them)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_engine
from checkpoints import tiny_smollm


def test_bench_engine_repeats_cases_and_reports_medians(tmp_path, capsys):
    model_dir = tiny_smollm(tmp_path / "model")
    out = tmp_path / "bench.json"
    argv = [
        "--model-dir",
        str(model_dir),
        "--cases",
        "a,b",
        "--repeats",
        "2",
        "--threads",
        str(torch.get_num_threads()),
        "--hf-batch",
        "8",
        "--skip-hf",
        "a",
        "--out",
        str(out),
    ]
    assert bench_engine.main(argv) == 0
    printed = capsys.readouterr().out
    assert "case a:" in printed and "case b:" in printed and "medians of 2 runs" in printed
    results = json.loads(out.read_text())
    b = results["cases"]["b"]
    assert b["num_requests"] == 64 and b["output_tokens"] == 64 * 128 and b["hf_batch"] == 8
    assert len(b["engine_runs"]) == 2 and len(b["hf_runs"]) == 2
    assert sorted(b["engine_runs"])[0] <= b["engine_tok_s"] <= sorted(b["engine_runs"])[1]
    assert b["ratio"] == b["engine_tok_s"] / b["hf_tok_s"]


def test_bench_engine_rejects_zero_repeats(capsys):
    with pytest.raises(SystemExit):
        bench_engine.main(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err
