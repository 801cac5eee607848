"""benchmarks.llama_cpp_compare without llama.cpp: options, the llama-server command, the summary table."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import llama_cpp_compare as compare


def _args(tmp_path: Path, *extra: str):
    return compare.parse_args(
        [
            "--llama-bin",
            str(tmp_path / "bin"),
            "--model",
            "ckpt",
            "--out",
            str(tmp_path / "run"),
            *extra,
        ]
    )


def test_defaults_and_llama_server_command(tmp_path):
    args = _args(tmp_path, "--concurrency", "1,16")
    assert args.concurrency == [1, 16] and args.skip == set()
    assert args.gguf == tmp_path / "model-bf16.gguf"
    cmd = compare.llama_server_command(args, 8123, 16)
    assert cmd[0] == str(tmp_path / "bin" / "llama-server")
    assert cmd[cmd.index("--parallel") + 1] == "16"
    assert cmd[cmd.index("-c") + 1] == str(16 * (128 + 128 + 64))  # per-slot context fits a request
    assert (
        "--no-cache-prompt" in cmd and cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "2"
    )
    assert compare.num_prompts(1) == 8 and compare.num_prompts(64) == 128


@pytest.mark.parametrize("bad", [["--skip", "llama,nope"], ["--concurrency", "0,4"]])
def test_bad_options_exit(tmp_path, bad):
    with pytest.raises(SystemExit):
        _args(tmp_path, *bad)


def test_markdown_summary():
    row = dict(
        concurrency=1,
        completed=8,
        output_tokens=1024,
        content_chunks=1022,
        output_tok_s=115.6,
        tpot_p50_ms=8.1,
        ttft_p50_ms=46.3,
        prefix_cache_hits=0.0,
    )
    summary = {
        "llama-server": [{**row, "prefix_cache_hits": None}],
        "kvserve": [row],
        "offline": {
            "kvserve": [{"batch_size": 1, "output_tok_s": 110.2, "tpot_ms": 8.83}],
            "llama-bench": [{"n_prompt": 128, "n_gen": 0, "avg_tok_s": 2143.0}],
        },
        "startup": {"kvserve": {"runs_s": [4.2, 4.3], "median_s": 4.25}},
    }
    text = compare.markdown(summary)
    assert "| llama-server | 1 | 115.6 | 8.10 | 46.3 | 8 (1024 tok, 1022 chunks) | - |" in text
    assert "| kvserve | 1 |" in text and "0.0 |" in text
    assert "offline kvserve, batch 1: 110.2 output tok/s, 8.83 ms/token" in text
    assert "prompt 128 / gen 0: 2143.0 tok/s" in text and "median 4.25 s (4.20, 4.30)" in text
