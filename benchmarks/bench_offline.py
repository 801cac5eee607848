"""The offline engine on a serving benchmark's workload: the figures a server should reach.

    python -m benchmarks.bench_offline --model DIR --input-len 128 --output-len 128 \
        --batch-sizes 1,16,64 --repeats 3 [--dtype bfloat16]

For each batch size B, `LLM.generate` runs B random prompts at once (greedy, EOS
ignored) and reports output tokens/s: compare it with `loadtest serve
--max-concurrency B` against `kvserve serve` on the same model. For B = 1 it also
reports the decode time per output token (the run minus a 1-token run, over the
remaining tokens): compare it with the server's TPOT at concurrency 1. Medians of
--repeats runs; every run is kept in the JSON (--out).

The KV pool is faulted in before the runs, as `kvserve serve`'s engine core does in the
background once it is ready.

`--arrival-gap-ms G` adds request i G*i ms after the first (the engine steps meanwhile), as
a server's requests trickle in: the first steps then run partial batches, as they do when
served. The default, 0, hands every prompt to the engine at once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np


def _run(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from kvserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


_request_ids = itertools.count()


def _run_staggered(llm, prompts: list[list[int]], max_tokens: int, gap_s: float) -> float:
    """Request i joins `gap_s` * i seconds after the first; returns the seconds to the last token."""
    from kvserve.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    num_added = 0
    while num_added < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while num_added < len(prompts) and num_added * gap_s <= now:
            engine.add_request(f"staggered-{next(_request_ids)}", prompts[num_added], params)
            num_added += 1
        if engine.has_unfinished_requests():
            engine.step()
        else:
            time.sleep(max(0.0, num_added * gap_s - now))
    return time.perf_counter() - start


def measure(
    llm,
    vocab_size: int,
    batch_size: int,
    input_len: int,
    output_len: int,
    seed: int,
    arrival_gap_s: float = 0.0,
) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab_size, input_len).tolist() for _ in range(batch_size)]
    if arrival_gap_s > 0:
        elapsed = _run_staggered(llm, prompts, output_len, arrival_gap_s)
    else:
        elapsed = _run(llm, prompts, output_len)
    result = {
        "batch_size": batch_size,
        "seconds": elapsed,
        "output_tok_s": batch_size * output_len / elapsed,
    }
    if batch_size == 1 and output_len > 1:
        first = _run(llm, [rng.integers(3, vocab_size, input_len).tolist()], 1)
        result["tpot_ms"] = 1000 * (elapsed - first) / (output_len - 1)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_offline", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,16,64", help="comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arrival-gap-ms",
        type=float,
        default=0.0,
        help="request i joins G*i ms after the first (0: all at once)",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (docs/scaling.md)")
    p.add_argument(
        "--quantization", default=None, help="none, int8, int4, fp8 (default: the checkpoint's own)"
    )
    p.add_argument("--out", help="JSON file for every run")
    args = p.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.repeats < 1 or min(batch_sizes) < 1 or args.output_len < 1 or args.input_len < 1:
        p.error("--repeats, --batch-sizes, --input-len and --output-len must be positive")
    if args.arrival_gap_ms < 0:
        p.error(f"--arrival-gap-ms must be >= 0, got {args.arrival_gap_ms}")

    from kvserve.engine import LLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        enable_prefix_caching=False,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
    )
    vocab_size = llm.engine.info.vocab_size
    _run(llm, [[5] * args.input_len], 4)  # warm-up
    # the KV pool's pages faulted in, as a served engine core does (in the background) once it is
    # ready: the first runs do not pay the OS zeroing them
    layers = getattr(llm.engine.runner, "attn_layers", None)
    if layers:
        from kvserve.engine.worker.kv_pool import prefault

        prefault(layers)
    runs: dict[int, list[dict]] = {b: [] for b in batch_sizes}
    for repeat in range(args.repeats):
        for b in batch_sizes:
            runs[b].append(
                measure(
                    llm,
                    vocab_size,
                    b,
                    args.input_len,
                    args.output_len,
                    args.seed + repeat,
                    args.arrival_gap_ms / 1000,
                )
            )
    summary = []
    for b in batch_sizes:
        row = {
            "batch_size": b,
            "output_tok_s": statistics.median(r["output_tok_s"] for r in runs[b]),
        }
        if "tpot_ms" in runs[b][0]:
            row["tpot_ms"] = statistics.median(r["tpot_ms"] for r in runs[b])
        summary.append(row)
        extra = f", decode {row['tpot_ms']:.2f} ms/token" if "tpot_ms" in row else ""
        print(
            f"batch {b:4d}: {row['output_tok_s']:8.1f} output tok/s{extra} (median of {args.repeats})"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "machine": platform.processor() or platform.machine(),
                    "summary": summary,
                    "runs": runs,
                },
                indent=1,
            )
        )
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
