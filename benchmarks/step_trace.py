"""Time every engine step of a staggered workload and print the slow ones: finds one-time stalls
(a kernel compiled on first use, a first allocation) that a short serving benchmark averages in.

    python -m benchmarks.step_trace --model DIR [--device cuda] [--requests 32] [--every 2] \
        [--input-len 256] [--output-len 64] [--rounds 2] [--warm-up]

A new request (random prompt, greedy, EOS ignored) joins every `--every` steps, so prefill and
decode rows mix as they do under a server; the same workload runs `--rounds` times on one
engine. Each step slower than `--slow` times the round's median is printed with what the batch
held; a stall that shows in round 1 only is warm-up. `--warm-up` first runs the dummy step the
server's engine core runs before it reports ready (`ModelRunner.warm_up`): what is left in round
1 then is what a served first request would still pay.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvserve.engine import LLM, SamplingParams


def run_round(
    llm: LLM, prompts: list[list[int]], every: int, output_len: int, tag: str
) -> list[tuple]:
    """(step, ms, running, waiting) for every step of one staggered round."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    pending = list(enumerate(prompts))
    trace, step = [], 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"{tag}-{i}", prompt, params)
        start = time.perf_counter()
        engine.step()
        elapsed_ms = 1000 * (time.perf_counter() - start)
        stats = engine.stats()
        trace.append((step, elapsed_ms, stats.num_running, stats.num_waiting))
        step += 1
    return trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.step_trace", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--every", type=int, default=2, help="steps between two arrivals")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--warm-up", action="store_true", help="run the engine core's warm-up step first"
    )
    p.add_argument(
        "--slow", type=float, default=5.0, help="print steps slower than this x the median"
    )
    args = p.parse_args(argv)
    if (
        min(args.requests, args.every, args.input_len, args.output_len, args.rounds) < 1
        or args.slow <= 1
    ):
        p.error(
            "--requests, --every, --input-len, --output-len, --rounds must be >= 1 and --slow > 1"
        )

    start = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    print(f"engine up in {time.perf_counter() - start:.2f} s on {llm.engine.info.device}")
    if args.warm_up:
        start = time.perf_counter()
        llm.engine.runner.warm_up()
        print(f"warm-up step {1000 * (time.perf_counter() - start):.1f} ms")
    rng = np.random.default_rng(0)
    vocab = llm.engine.info.vocab_size
    for r in range(1, args.rounds + 1):
        prompts = [rng.integers(3, vocab, args.input_len).tolist() for _ in range(args.requests)]
        trace = run_round(llm, prompts, args.every, args.output_len, f"r{r}")
        times = [ms for _, ms, _, _ in trace]
        median = statistics.median(times)
        print(
            f"round {r}: {len(trace)} steps, median {median:.2f} ms, max {max(times):.1f} ms, "
            f"total {sum(times) / 1000:.2f} s"
        )
        for step, ms, running, waiting in trace:
            if ms > args.slow * median:
                print(f"  step {step:4d}: {ms:8.1f} ms  running {running:3d}  waiting {waiting:3d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
