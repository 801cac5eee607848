"""loadtest/ end to end: real servers on loopback, a few seconds of load each.

(a) benchmarks/baseline_server.py on a tiny checkpoint; (b) a real `kvserve serve`.
Checks consistency, never speed: counts add up, token totals match the servers'
usage, percentiles are ordered, result.json and PNG plots are written, and after
a run with deliberate disconnects kvserve's KV cache usage is back to 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.procs import free_port, running_server
from kvserve.loadtest import cli

pytestmark = pytest.mark.slow  # real servers; a minute or so on 2 CPU cores

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    from checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("loadtest_ckpt") / "llama", "llama")


@pytest.fixture(scope="module")
def baseline_url(tiny_checkpoint, tmp_path_factory):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.baseline_server",
        "--model",
        tiny_checkpoint,
        "--port",
        str(port),
    ]
    log = tmp_path_factory.mktemp("baseline_log") / "server.log"
    with running_server(cmd, port, log, timeout_s=120) as url:  # always stopped on exit
        yield url


@pytest.fixture(scope="module")
def kvserve_url(tiny_checkpoint, tmp_path_factory):
    pytest.importorskip(
        "kvserve.server.app", reason="kvserve server (server/app.py) not available yet"
    )
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvserve.server.cli",
        "serve",
        "--model",
        tiny_checkpoint,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]
    log = tmp_path_factory.mktemp("kvserve_log") / "server.log"
    with running_server(cmd, port, log, timeout_s=180) as url:
        yield url


def run_bench(url: str, out: Path, *options: str) -> dict:
    argv = ["serve", "--base-url", url, "--out", str(out), "--no-progress", "--seed", "0", *options]
    assert cli.main(argv) == 0
    return json.loads((out / "result.json").read_text())


def check_consistent(doc: dict, num_sent: int) -> None:
    s, records = doc["summary"], doc["requests"]
    assert s["num_sent"] == len(records) == num_sent
    assert s["completed"] + s["failed"] + s["disconnected"] == num_sent
    assert s["failed"] == 0, s["failure_reasons"]
    ok = [r for r in records if r["status"] == "ok"]
    assert all(r["has_usage"] and r["output_tokens"] == r["max_tokens"] for r in ok)  # ignore_eos
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in ok)
    assert s["total_prompt_tokens"] == sum(r["prompt_tokens"] for r in ok)
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert s[key]["p50_ms"] <= s[key]["p90_ms"] <= s[key]["p99_ms"]
    for r in ok:
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["sent_s"] >= r["scheduled_s"] - 1e-3


def check_plots(out: Path, names: tuple[str, ...]) -> None:
    for name in names:
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data[:8] == PNG_SIGNATURE


def test_baseline_server_run(baseline_url, tmp_path):
    doc = run_bench(
        baseline_url,
        tmp_path,
        "--num-prompts",
        "12",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--range-ratio",
        "0.5",
        "--max-concurrency",
        "4",
        "--disconnect-fraction",
        "0.25",
        "--goodput",
        "ttft:600000",
        "e2el:600000",
    )
    check_consistent(doc, 12)
    s = doc["summary"]
    assert s["disconnected"] == 3 and s["completed"] == 9
    assert s["good_requests"] == 9 and s["peak_concurrency"] <= 4
    assert doc["server_metrics"] == {"available": False}  # the baseline has no /metrics
    assert doc["config"]["model"] == Path(doc["config"]["model"]).name  # from GET /v1/models
    check_plots(tmp_path, ("latency_cdf.png", "timeline.png"))
    assert not (tmp_path / "kv_cache.png").exists()


def test_baseline_chat_endpoint(baseline_url, tmp_path):
    doc = run_bench(
        baseline_url,
        tmp_path,
        "--endpoint",
        "chat",
        "--num-prompts",
        "4",
        "--input-len",
        "12",
        "--output-len",
        "6",
        "--request-rate",
        "50",
    )
    check_consistent(doc, 4)
    assert doc["summary"]["completed"] == 4


def test_baseline_duration_mode_closed_loop(baseline_url, tmp_path):
    doc = run_bench(
        baseline_url,
        tmp_path,
        "--duration",
        "2",
        "--max-concurrency",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "4",
    )
    s = doc["summary"]
    check_consistent(doc, s["num_sent"])
    assert s["num_sent"] >= 2 and s["peak_concurrency"] <= 2
    assert doc["config"]["duration_s"] == 2.0 and doc["config"]["num_prompts"] is None


def test_kvserve_run_with_disconnects_frees_kv_cache(kvserve_url, tmp_path):
    doc = run_bench(
        kvserve_url,
        tmp_path,
        "--num-prompts",
        "24",
        "--input-len",
        "32",
        "--output-len",
        "16",
        "--request-rate",
        "40",
        "--burstiness",
        "0.5",
        "--disconnect-fraction",
        "0.5",
        "--metrics-interval",
        "0.05",
    )
    check_consistent(doc, 24)
    s, server = doc["summary"], doc["server_metrics"]
    # 12 clients plan to hang up after k chunks; a stream with fewer chunks (a busy
    # server merges tokens into one chunk, more so on a loaded CI machine) completes
    # normally instead. Seed 0 plans one hang-up right after the headers, which
    # always happens; how many of the others do depends on load.
    planned = [r for r in doc["requests"] if r["disconnect_after_chunks"] is not None]
    assert len(planned) == 12 and any(r["disconnect_after_chunks"] == 0 for r in planned)
    assert s["disconnected"] == sum(r["status"] == "disconnected" for r in doc["requests"]) >= 1
    for r in planned:
        assert r["status"] == "disconnected" or r["num_chunks"] < r["disconnect_after_chunks"]
    # The KV gauge is sampled, and a 0.5 s run can fall between busy moments: assert
    # it was read, not that a sample caught it above zero (the counters below are exact).
    assert server["available"] and server["peak_kv_cache_usage"] is not None
    assert server["kv_cache_back_to_zero"] is True
    # The server generated at least what the clients received (more if it ran past a hang-up).
    assert server["generation_tokens"] >= s["output_tokens_all_requests"]
    assert any("kv_cache_usage" in sample for sample in doc["metrics_series"])
    check_plots(tmp_path, ("latency_cdf.png", "timeline.png", "kv_cache.png"))


def test_kvserve_sweep_and_prefix_cache(kvserve_url, tmp_path):
    assert (
        cli.main(
            [
                "serve",
                "--base-url",
                kvserve_url,
                "--out",
                str(tmp_path),
                "--no-progress",
                "--dataset",
                "prefix-repetition",
                "--prefix-len",
                "48",
                "--num-prefix-groups",
                "2",
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--num-prompts",
                "8",
                "--max-concurrency",
                "1",
                "4",
            ]
        )
        == 0
    )
    points = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["label"] for p in points] == ["rate-inf_conc-1", "rate-inf_conc-4"]
    for p in points:
        doc = json.loads((tmp_path / p["label"] / "result.json").read_text())
        check_consistent(doc, 8)
        # 2 groups x 4 prompts: at least the 3 later prompts of each group reuse 48 prefix tokens.
        assert doc["server_metrics"]["prefix_cache_hits"] >= 6 * 32
    assert "| rate-inf_conc-4 |" in (tmp_path / "sweep.md").read_text()
    check_plots(tmp_path, ("sweep.png",))
