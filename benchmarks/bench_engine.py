"""Offline throughput: the kvserve engine vs `transformers` generate, side by side in one run.

    python -m benchmarks.bench_engine [--dtype bfloat16] [--threads 2] [--cases a,b,c] [--repeats 1]

On the SmolLM-135M-shaped random Llama (benchmarks/smollm_checkpoint.py), greedy,
EOS ignored so every request produces exactly its requested tokens:
  (a) 1 request, prompt 128, 128 new tokens   vs transformers at batch 1
  (b) 64 requests, prompt 128, 128 new tokens vs transformers' static batch of 32
  (c) 256 requests, prompts 16-512, outputs 16-256 (uniform, seeded)
      vs transformers in static batches of 32 (left-padded; each batch runs until
      its longest request is done; only requested tokens count)
Prints output tokens/s for each and the ratios; writes the figures as JSON. With
--repeats N each case runs N times, engine and transformers alternating, and the
medians are compared (a 2-vCPU VM's figures move 10-20% between runs; transformers'
batch-32 figure has swung from 119 to 159 tok/s).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.smollm_checkpoint import build_smollm_like


def make_case(
    name: str, vocab_size: int, rng: np.random.Generator
) -> tuple[list[list[int]], list[int]]:
    if name == "a":
        lens, outs = [128], [128]
    elif name == "b":
        lens, outs = [128] * 64, [128] * 64
    else:
        lens = rng.integers(16, 513, 256).tolist()
        outs = rng.integers(16, 257, 256).tolist()
    prompts = [rng.integers(3, vocab_size, n).tolist() for n in lens]
    return prompts, outs


def run_engine(llm, prompts: list[list[int]], outs: list[int]) -> float:
    from kvserve.engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    assert produced == sum(outs), (produced, sum(outs))
    return produced / elapsed


def left_pad(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask [len(batch), longest], prompts right-aligned (as generate wants)."""
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, p in enumerate(batch):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], outs: list[int], batch_size: int) -> float:
    """Static batches in arrival order, left-padded; counts only the requested tokens."""
    produced, elapsed = 0, 0.0
    for i in range(0, len(prompts), batch_size):
        batch, wanted = prompts[i : i + batch_size], outs[i : i + batch_size]
        ids, mask = left_pad(batch)
        new = max(wanted)
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        elapsed += time.perf_counter() - start
        produced += sum(wanted)
    return produced / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", default="loadtest_out/models/smollm-135m-random")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quantization",
        default=None,
        choices=["none", "int8", "int4"],
        help="the engine's weights (transformers stays unquantized)",
    )
    parser.add_argument("--cases", default="a,b,c", help="comma-separated subset of a,b,c")
    parser.add_argument(
        "--skip-hf", default="", help="cases for which transformers is not run, e.g. c"
    )
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per case; medians are reported"
    )
    parser.add_argument("--out", default="bench_out/bench_engine.json")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    torch.set_num_threads(args.threads)
    model_dir = str(build_smollm_like(args.model_dir))
    from transformers import AutoModelForCausalLM

    from kvserve.engine import LLM

    llm = LLM(
        model_dir,
        dtype=args.dtype,
        device="cpu",
        enable_prefix_caching=False,
        quantization=args.quantization,
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    vocab = llm.engine.info.vocab_size
    warm = [[5] * 64]
    run_engine(llm, warm, [8])
    run_hf(hf, warm, [8], 1)

    results = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "dtype": args.dtype,
        "quantization": args.quantization or "none",
        "torch": torch.__version__,
        "cases": {},
    }
    skip_hf = set(args.skip_hf.split(","))
    for case in args.cases.split(","):
        prompts, outs = make_case(case, vocab, np.random.default_rng(0))
        hf_batch = 1 if case == "a" else args.hf_batch
        if case == "b":  # transformers' reference is one static batch of hf_batch
            prompts_hf, outs_hf = prompts[:hf_batch], outs[:hf_batch]
        else:
            prompts_hf, outs_hf = prompts, outs
        engine_runs, hf_runs = [], []
        for _ in range(args.repeats):
            engine_runs.append(run_engine(llm, prompts, outs))
            if case not in skip_hf:
                hf_runs.append(run_hf(hf, prompts_hf, outs_hf, hf_batch))
        engine_tps = statistics.median(engine_runs)
        hf_tps = statistics.median(hf_runs) if hf_runs else None
        ratio = engine_tps / hf_tps if hf_tps else None
        results["cases"][case] = dict(
            num_requests=len(prompts),
            output_tokens=sum(outs),
            engine_tok_s=engine_tps,
            hf_tok_s=hf_tps,
            hf_batch=hf_batch,
            ratio=ratio,
            engine_runs=engine_runs,
            hf_runs=hf_runs,
        )
        hf_text = f"{hf_tps:8.1f}" if hf_tps else "     n/a"
        ratio_text = f"{ratio:5.2f}x" if ratio else "   n/a"
        runs_text = (
            ""
            if args.repeats == 1
            else (
                "  (medians of "
                + f"{args.repeats} runs: engine "
                + " ".join(f"{x:.1f}" for x in engine_runs)
                + "; transformers "
                + (" ".join(f"{x:.1f}" for x in hf_runs) or "n/a")
                + ")"
            )
        )
        print(
            f"case {case}: {len(prompts):3d} requests  engine {engine_tps:8.1f} tok/s  "
            f"transformers (batch {hf_batch}) {hf_text} tok/s  ratio {ratio_text}{runs_text}",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
