"""Smoke test of the start-up benchmark (it prints times; nothing here checks them)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_startup


def test_bench_startup_serves_once_and_times_the_engine(llama_dir, tmp_path, capsys):
    out = tmp_path / "startup.json"
    argv = [
        "--model",
        llama_dir,
        "--repeats",
        "1",
        "--offline",
        "--out",
        str(out),
        "--",
        "--device",
        "cpu",
    ]
    assert bench_startup.main(argv) == 0
    printed = capsys.readouterr().out
    assert "serve start-up 1/1" in printed and "LLMEngine 1/1" in printed
    results = json.loads(out.read_text())
    assert results["serve_flags"] == ["--device", "cpu"] and len(results["serve_s"]) == 1
    assert results["offline"][0]["phases"].startswith("engine start-up")


def test_bench_startup_rejects_zero_repeats(capsys):
    with pytest.raises(SystemExit):
        bench_startup.main(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err
