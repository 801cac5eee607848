"""kvserve vs llama.cpp's `llama-server` on one machine: same checkpoint, client, prompts and threads.

    python -m benchmarks.llama_cpp_compare --llama-bin /work/llama-build/bin \\
        --llama-cpp-dir LLAMA_CPP_SRC --convert-python /work/llama-venv/bin/python \\
        --model loadtest_out/models/smollm-135m-random --dtype bfloat16 --threads 2 \\
        --concurrency 1,16,64 --seed 1000 --out loadtest_out/llama_cpp_compare/run1

Steps (each can be left out with --skip):
- convert: the HF checkpoint to GGUF with llama.cpp's `convert_hf_to_gguf.py` (run by
  --convert-python, which needs torch, transformers and sentencepiece), unless --gguf exists.
  A tokenizer whose BPE pre-tokenizer hash the converter does not know (any freshly built one)
  is registered as --pre-tokenizer (default "gpt-2": the GPT-2 split regex, which is what an HF
  `ByteLevel(use_regex=True)` pre-tokenizer does); known hashes are converted as usual.
- llama: for each concurrency C a fresh `llama-server -t T -tb T -ngl 0 --parallel C` with
  prompt caching off, then `python -m kvserve.loadtest serve --max-concurrency C` against it.
- kvserve: one `kvserve serve --dtype D`, then the same `loadtest serve` runs against it; with
  --kvserve-gguf it serves the same GGUF file as llama.cpp (a Q8_0 / Q4_0 file held as int8 / int4).
- offline: `python -m benchmarks.bench_offline` (kvserve's engine, no server), and llama.cpp's
  `llama-batched-bench` (no server, no sampling) if it is in --llama-bin.
- startup: launch to first `GET /health` 200, --startup-repeats times, for both servers.

Prompts: random token ids, seed --seed + C for concurrency C, so within one server's lifetime no
run re-sends an earlier run's prompts (kvserve caches prefixes), and both servers get the same
prompts. Use a different --seed for every repeat of the whole comparison. Writes every result
under --out and a summary table (summary.md, summary.json); run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_startup import serve_command, time_to_healthy
from benchmarks.procs import free_port, running_server

STEPS = ("convert", "llama", "kvserve", "offline", "startup")
_GGUF_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}

# Runs convert_hf_to_gguf.py with a fallback for unknown BPE pre-tokenizer hashes.
_CONVERT_CHILD = """
import runpy, sys
llama_dir, pre_name, *argv = sys.argv[1:]
sys.path[:0] = [llama_dir, llama_dir + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print(f"unknown BPE pre-tokenizer hash: registered as {pre_name!r}", file=sys.stderr)
        return pre_name
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [llama_dir + "/convert_hf_to_gguf.py", *argv]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(args: argparse.Namespace) -> None:
    if args.llama_cpp_dir is None:
        raise ValueError(
            f"--gguf {args.gguf} does not exist and no --llama-cpp-dir was given to convert"
        )
    args.gguf.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        args.convert_python,
        "-c",
        _CONVERT_CHILD,
        str(args.llama_cpp_dir),
        args.pre_tokenizer,
        args.model,
        "--outtype",
        _GGUF_TYPES[args.dtype],
        "--outfile",
        str(args.gguf),
    ]
    subprocess.run(cmd, check=True)


def num_prompts(concurrency: int) -> int:
    return max(8, 2 * concurrency)


def llama_server_command(args: argparse.Namespace, port: int, parallel: int) -> list[str]:
    per_slot = args.input_len + args.output_len + 64  # each slot gets n_ctx / parallel
    return [
        str(args.llama_bin / "llama-server"),
        "-m",
        str(args.gguf),
        "--alias",
        args.name,
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-ngl",
        "0",
        "--parallel",
        str(parallel),
        "-c",
        str(parallel * per_slot),
        "--no-cache-prompt",
        "--cache-ram",
        "0",
        "--no-webui",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *shlex.split(args.llama_args),
    ]


def kvserve_model(args: argparse.Namespace) -> str:
    """What kvserve serves: the HF checkpoint, or with --kvserve-gguf the same GGUF file as llama.cpp
    (held as the file holds it: Q8_0 as int8, Q4_0 as int4)."""
    return str(args.gguf) if args.kvserve_gguf else args.model


def kvserve_command(args: argparse.Namespace, port: int) -> list[str]:
    return serve_command(
        kvserve_model(args),
        port,
        ["--dtype", args.dtype, "--served-model-name", args.name, *shlex.split(args.kvserve_args)],
    )


def run_client(args: argparse.Namespace, base_url: str, concurrency: int, out: Path) -> dict:
    """One `loadtest serve` point; returns the figures the summary table shows."""
    cmd = [
        sys.executable,
        "-m",
        "loadtest",
        "serve",
        "--base-url",
        base_url,
        "--model",
        args.name,
        "--tokenizer",
        args.model,
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--max-concurrency",
        str(concurrency),
        "--num-prompts",
        str(num_prompts(concurrency)),
        "--seed",
        str(args.seed + concurrency),
        "--no-progress",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True)
    result = json.loads((out / "result.json").read_text())
    summary, server = result["summary"], result.get("server_metrics") or {}
    return {
        "concurrency": concurrency,
        "completed": summary["completed"],
        "output_tokens": summary["total_output_tokens"],  # from each stream's usage chunk
        "content_chunks": sum(r["num_chunks"] for r in result["requests"]),
        "output_tok_s": summary["output_throughput"],
        "tpot_p50_ms": summary["tpot"]["p50_ms"],
        "ttft_p50_ms": summary["ttft"]["p50_ms"],
        "prefix_cache_hits": server.get("prefix_cache_hits"),
    }


def serve_llama(args: argparse.Namespace, out: Path) -> list[dict]:
    rows = []
    for c in args.concurrency:
        port = free_port()
        with running_server(
            llama_server_command(args, port, c), port, out / f"llama-server-{c}.log"
        ) as url:
            rows.append(run_client(args, url, c, out / f"llama-server_conc-{c}"))
    return rows


def serve_kvserve(args: argparse.Namespace, out: Path) -> list[dict]:
    port = free_port()
    with running_server(kvserve_command(args, port), port, out / "kvserve.log") as url:
        return [run_client(args, url, c, out / f"kvserve_conc-{c}") for c in args.concurrency]


def offline(args: argparse.Namespace, out: Path) -> dict:
    batch_sizes = ",".join(map(str, args.concurrency))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_offline",
            "--model",
            kvserve_model(args),
            "--dtype",
            args.dtype,
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--batch-sizes",
            batch_sizes,
            "--repeats",
            str(args.offline_repeats),
            "--seed",
            str(args.seed),
            "--out",
            str(out / "bench_offline.json"),
        ],
        check=True,
    )
    result = {"kvserve": json.loads((out / "bench_offline.json").read_text())["summary"]}
    batched_bench = args.llama_bin / "llama-batched-bench"
    if batched_bench.exists():
        n_kv = max(args.concurrency) * (args.input_len + args.output_len) + 256
        proc = subprocess.run(
            [
                str(batched_bench),
                "-m",
                str(args.gguf),
                "-t",
                str(args.threads),
                "-tb",
                str(args.threads),
                "-ngl",
                "0",
                "-c",
                str(n_kv),
                "-b",
                "2048",
                "-ub",
                "512",
                "-npp",
                str(args.input_len),
                "-ntg",
                str(args.output_len),
                "-npl",
                batch_sizes,
                "--output-format",
                "jsonl",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        (out / "llama-batched-bench.log").write_text(proc.stdout + proc.stderr)
        rows = [
            json.loads(line)
            for line in (proc.stdout + proc.stderr).splitlines()
            if line.startswith("{")
        ]
        result["llama.cpp"] = [
            {
                "batch_size": r["pl"],
                "output_tok_s": r["pl"] * r["tg"] / r["t"],
                "decode_tok_s": r["speed_tg"],
                "prefill_tok_s": r["speed_pp"],
            }
            for r in rows
        ]
    bench = args.llama_bin / "llama-bench"
    if bench.exists():  # one sequence: prefill and decode speeds apart
        proc = subprocess.run(
            [
                str(bench),
                "-m",
                str(args.gguf),
                "-t",
                str(args.threads),
                "-ngl",
                "0",
                "-p",
                str(args.input_len),
                "-n",
                str(args.output_len),
                "-r",
                "3",
                "-o",
                "json",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        result["llama-bench"] = [
            {"n_prompt": r["n_prompt"], "n_gen": r["n_gen"], "avg_tok_s": r["avg_ts"]}
            for r in json.loads(proc.stdout)
        ]
    return result


def startup(args: argparse.Namespace, out: Path) -> dict:
    times: dict[str, list[float]] = {"llama-server": [], "kvserve": []}
    with tempfile.TemporaryDirectory(prefix="llama-compare-") as tmp:
        for i in range(args.startup_repeats):
            for name in times:
                port = free_port()
                cmd = (
                    llama_server_command(args, port, 1)
                    if name == "llama-server"
                    else kvserve_command(args, port)
                )
                times[name].append(time_to_healthy(cmd, port, Path(tmp) / f"{name}-{i}.log", 300.0))
    result = {name: {"runs_s": t, "median_s": statistics.median(t)} for name, t in times.items()}
    (out / "startup.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def versions(args: argparse.Namespace) -> dict:
    proc = subprocess.run(
        [str(args.llama_bin / "llama-server"), "--version"], capture_output=True, text=True
    )
    llama = " ".join(
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if "version" in line or "built" in line
    )
    kvserve = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {"llama-server": llama, "kvserve_commit": kvserve}


def markdown(summary: dict) -> str:
    lines = [
        "| | C | output tok/s | TPOT p50 ms | TTFT p50 ms | requests (tokens, chunks) | prefix-cache hits |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for server in ("llama-server", "kvserve"):
        for r in summary.get(server, []):
            hits = "-" if r["prefix_cache_hits"] is None else r["prefix_cache_hits"]
            lines.append(
                f"| {server} | {r['concurrency']} | {r['output_tok_s']:.1f} | {r['tpot_p50_ms']:.2f} | "
                f"{r['ttft_p50_ms']:.1f} | {r['completed']} ({r['output_tokens']} tok, "
                f"{r['content_chunks']} chunks) | {hits} |"
            )
    lines.append("")
    for engine, rows in summary.get("offline", {}).items():
        if engine == "llama-bench":
            lines += [
                f"- llama-bench, 1 sequence, prompt {r['n_prompt']} / gen {r['n_gen']}: "
                f"{r['avg_tok_s']:.1f} tok/s (mean of 3)"
                for r in rows
            ]
            continue
        for r in rows:
            tpot = f", {r['tpot_ms']:.2f} ms/token" if "tpot_ms" in r else ""
            lines.append(
                f"- offline {engine}, batch {r['batch_size']}: {r['output_tok_s']:.1f} output tok/s{tpot}"
            )
    for name, s in summary.get("startup", {}).items():
        runs = ", ".join(f"{t:.2f}" for t in s["runs_s"])
        lines.append(f"- start-up to /health 200, {name}: median {s['median_s']:.2f} s ({runs})")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.llama_cpp_compare", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--llama-bin",
        type=Path,
        required=True,
        help="folder with llama-server (and llama-batched-bench)",
    )
    p.add_argument(
        "--model",
        required=True,
        help="HF checkpoint directory (kvserve's model, the GGUF's source)",
    )
    p.add_argument(
        "--gguf",
        type=Path,
        help="GGUF file (default: OUT/../model-DTYPE.gguf; converted if missing)",
    )
    p.add_argument(
        "--llama-cpp-dir", type=Path, help="llama.cpp source tree (has convert_hf_to_gguf.py)"
    )
    p.add_argument(
        "--convert-python", default=sys.executable, help="python that runs the converter"
    )
    p.add_argument(
        "--pre-tokenizer", default="gpt-2", help="llama.cpp pre-tokenizer for unknown BPE hashes"
    )
    p.add_argument(
        "--kvserve-gguf",
        action="store_true",
        help="kvserve serves the --gguf file too (e.g. a Q8_0 file, held as int8), not --model",
    )
    p.add_argument("--name", default="model", help="model name both servers serve")
    p.add_argument(
        "--llama-args", default="", help="more llama-server flags (e.g. speculative decoding's)"
    )
    p.add_argument("--kvserve-args", default="", help="more kvserve serve flags")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_GGUF_TYPES))
    p.add_argument(
        "--threads", type=int, default=2, help="llama.cpp's -t/-tb (kvserve uses torch's default)"
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated")
    p.add_argument("--seed", type=int, default=1000, help="prompts of concurrency C use seed + C")
    p.add_argument("--offline-repeats", type=int, default=3)
    p.add_argument("--startup-repeats", type=int, default=3)
    p.add_argument(
        "--skip", default="", help=f"comma-separated steps to leave out: {','.join(STEPS)}"
    )
    p.add_argument("--out", type=Path, required=True, help="folder for every result")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.skip = {s for s in args.skip.split(",") if s}
    if unknown := args.skip - set(STEPS):
        p.error(f"--skip: unknown steps {sorted(unknown)}; choose from {','.join(STEPS)}")
    if min(args.concurrency) < 1 or args.threads < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--concurrency, --threads, --input-len and --output-len must be positive")
    args.gguf = args.gguf or args.out.parent / f"model-{_GGUF_TYPES[args.dtype]}.gguf"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.gguf.exists() and "convert" not in args.skip:
        convert(args)
    summary: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions(args)}
    steps = [
        ("llama-server", "llama", serve_llama),
        ("kvserve", "kvserve", serve_kvserve),
        ("offline", "offline", offline),
        ("startup", "startup", startup),
    ]
    for key, step, fn in steps:
        if step not in args.skip:
            summary[key] = fn(args, args.out)
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    table = markdown(summary)
    (args.out / "summary.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
