"""LoRA on the offline engine: throughput over several adapters and batch-1 decode, against the base model.

    python -m benchmarks.bench_lora --work-dir loadtest_out/lora --num-adapters 1,4,16 --rank 16 \
        [--model DIR] [--device cuda] [--parts throughput,batch1] [--out lora.json]

Without --model it builds a random bf16 checkpoint shaped like SmolLM-135M (benchmarks/smollm_checkpoint.py)
in --work-dir; it writes --max-adapters random PEFT adapters of rank --rank on q/k/v/o/gate/up/down there
with `peft` (once; reused by later runs).

* throughput: --num-requests prompts of --input-len random tokens, --output-len new tokens each (greedy,
  EOS ignored), all handed to `LLM.generate` at once; on the base model alone (no `enable_lora`), then
  spread round-robin over N adapters (`enable_lora`, `max_loras=N`) for each N of --num-adapters.
  Output tokens/s and the ratio to the base model's. N = 0: `enable_lora` but every request on the
  base model (what serving adapters costs before any adapter runs: on the CPU, whether the C++
  decoder stack stays on).
* batch1: one request's decode time per output token (the run minus a 1-token run, over the remaining
  tokens, as benchmarks/bench_offline.py), on the base model and under one adapter, alternating.

Medians of --repeats runs; every run is kept in the JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapters(base: Path, out: Path, count: int, rank: int, seed: int) -> list[Path]:
    """`count` PEFT adapters of rank `rank` on every target, random A and B (reused when already there)."""
    paths = [out / f"adapter-{i}" for i in range(count)]
    if all((p / "adapter_model.safetensors").exists() for p in paths):
        return paths
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    for path in paths:  # one model, new random weights per adapter
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        wrapped.save_pretrained(path)
    return paths


def _generate(llm, prompts: list[list[int]], max_tokens: int, loras) -> float:
    from kvserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start


def _prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, length).tolist() for _ in range(count)]


def _make_llm(args, num_adapters: int | None):
    from kvserve.engine import LLM

    lora = (
        {}
        if num_adapters is None
        else {"enable_lora": True, "max_loras": max(num_adapters, 1), "max_lora_rank": args.rank}
    )
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        enable_prefix_caching=False,
        max_num_seqs=max(args.num_requests, 1),
        **lora,
    )
    stack = llm.engine.runner.cpu_stack is not None
    return llm, stack


def _requests(paths: list[Path], num_adapters: int | None, count: int):
    from kvserve.engine.lora_request import LoRARequest

    if not num_adapters:
        return None
    loras = [LoRARequest(f"adapter-{i}", i + 1, str(paths[i])) for i in range(num_adapters)]
    return [loras[i % num_adapters] for i in range(count)]


def throughput(args, paths: list[Path], num_adapters: int | None) -> dict:
    llm, stack = _make_llm(args, num_adapters)
    vocab = llm.engine.info.vocab_size
    loras = _requests(paths, num_adapters, args.num_requests)
    _generate(
        llm,
        _prompts(vocab, min(args.num_requests, 4), args.input_len, 99),
        4,
        None if loras is None else loras[: min(args.num_requests, 4)],
    )  # warm-up (and reads the first adapters)
    runs = []
    for repeat in range(args.repeats):
        prompts = _prompts(vocab, args.num_requests, args.input_len, args.seed + repeat)
        seconds = _generate(llm, prompts, args.output_len, loras)
        runs.append(args.num_requests * args.output_len / seconds)
    llm.shutdown()
    return {
        "num_adapters": num_adapters,
        "cpu_stack": stack,
        "output_tok_s": statistics.median(runs),
        "runs": runs,
    }


def batch1(args, paths: list[Path]) -> list[dict]:
    """Batch-1 decode on the base model and under one adapter, the two engines alternating run by
    run (a shared machine's load moves between minutes: alternating keeps the pair comparable)."""
    engines = [_make_llm(args, None), _make_llm(args, 1)]
    loras = [None, _requests(paths, 1, 1)]
    vocab = engines[0][0].engine.info.vocab_size
    runs: list[list[float]] = [[], []]
    for repeat in range(-1, args.repeats):  # -1: warm-up
        for i, (llm, _) in enumerate(engines):
            whole = _generate(
                llm,
                _prompts(vocab, 1, args.input_len, args.seed + repeat + 1),
                args.output_len,
                loras[i],
            )
            first = _generate(
                llm, _prompts(vocab, 1, args.input_len, args.seed + 101 + repeat), 1, loras[i]
            )
            if repeat >= 0:
                runs[i].append(1000 * (whole - first) / (args.output_len - 1))
    for llm, _ in engines:
        llm.shutdown()
    return [
        {
            "adapter": bool(i),
            "cpu_stack": engines[i][1],
            "tpot_ms": statistics.median(runs[i]),
            "runs": runs[i],
        }
        for i in range(2)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_lora", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--model", help="base checkpoint directory (default: build a SmolLM-135M-shaped one)"
    )
    p.add_argument(
        "--work-dir", type=Path, default=Path("loadtest_out/lora"), help="checkpoint and adapters"
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the engine's device)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument(
        "--num-adapters",
        default="1,4,16",
        help="comma-separated adapter counts for the throughput part",
    )
    p.add_argument(
        "--max-adapters",
        type=int,
        default=16,
        help="adapters to write (at least the largest count)",
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--parts", default="throughput,batch1", help="throughput, batch1 or both")
    p.add_argument(
        "--skip-base", action="store_true", help="throughput: no base-model run (ratios left out)"
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON file for every run")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.num_adapters.split(",") if n]
    parts = set(args.parts.split(","))
    if not parts <= {"throughput", "batch1"}:
        p.error(f"--parts takes throughput and/or batch1, got {args.parts!r}")
    if min(counts, default=1) < 0 or max(counts, default=0) > args.max_adapters:
        p.error(
            f"--num-adapters must be between 0 and --max-adapters={args.max_adapters}, got {args.num_adapters!r}"
        )
    if min(args.rank, args.num_requests, args.input_len, args.repeats) < 1 or args.output_len < 2:
        p.error(
            "--rank, --num-requests, --input-len and --repeats must be positive, --output-len at least 2"
        )

    from benchmarks.smollm_checkpoint import build_smollm_like

    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = str(build_smollm_like(args.work_dir / "smollm-135m-random", dtype=args.dtype))
    paths = build_adapters(
        Path(args.model),
        args.work_dir / f"adapters-r{args.rank}",
        args.max_adapters,
        args.rank,
        args.seed,
    )
    result: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": platform.processor() or platform.machine(),
        "loadavg_start": os.getloadavg(),
    }
    if "throughput" in parts:
        rows = ([] if args.skip_base else [throughput(args, paths, None)]) + [
            throughput(args, paths, n) for n in counts
        ]
        base = None if args.skip_base else rows[0]["output_tok_s"]
        print(
            f"{args.num_requests} requests, {args.input_len} prompt + {args.output_len} new tokens, rank {args.rank}"
        )
        print(f"{'adapters':>8} {'stack':>5} {'output tok/s':>12} {'vs base':>8}")
        for row in rows:
            row["vs_base"] = None if base is None else row["output_tok_s"] / base
            ratio = "" if base is None else f"{row['vs_base']:8.1%}"
            name = "base" if row["num_adapters"] is None else row["num_adapters"]
            print(
                f"{name:>8} {'on' if row['cpu_stack'] else 'off':>5} {row['output_tok_s']:12.1f} {ratio}"
            )
        result["throughput"] = rows
    if "batch1" in parts:
        rows = batch1(args, paths)
        overhead = rows[1]["tpot_ms"] / rows[0]["tpot_ms"] - 1
        print(
            f"batch 1 decode: base {rows[0]['tpot_ms']:.2f} ms/token, one adapter {rows[1]['tpot_ms']:.2f} "
            f"ms/token ({overhead:+.1%}; stack {'on' if rows[1]['cpu_stack'] else 'off'} with the adapter)"
        )
        result["batch1"] = {"runs": rows, "overhead": overhead}
    result["loadavg_end"] = os.getloadavg()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
