"""GPU offline throughput: kvserve vs `transformers` generate on random Llama-shaped models, with a roofline.

    python -m benchmarks.bench_gpu --shape llama-1b|llama-8b|tiny --device cuda --cases a,b,c [--out FILE]

Writes a random-weight checkpoint of the shape (benchmarks/llama_shapes.py: straight from device
tensors, sharded safetensors), then runs, one model in memory at a time, bf16, greedy, EOS
ignored so every request produces exactly its requested tokens:
  (a) 1 request, prompt 128, 256 new tokens
  (b) 64 requests, prompt 1024, 256 new tokens
  (c) 256 requests, prompts 64-2048, outputs 32-512 (uniform, seeded)
with `--small` the same three cases shrunk (CPU smoke tests). Systems, side by side:
  kvserve           engine.LLM with CUDA graphs (the default)
  kvserve-eager     enforce_eager=True (cases in --eager-cases, default a)
  hf-eager          transformers generate, dynamic cache, not compiled; static batches, left-padded
                    (b: one batch of 64; c: batches of --hf-batch, run until --hf-budget-s is spent:
                    the figure is over the batches run, which the JSON counts)
  hf-compile        generate with its static cache, which transformers compiles (torch.compile,
                    CUDA graphs) on CUDA; cases in --hf-compile-cases (default a on CUDA, none on
                    CPU); the first call (compilation) is not timed; any failure is reported, not raised
Columns: output tok/s; ms per step (kvserve: per decode-only step, timed around the runner's
step, which ends in its one device-to-host sync; transformers: elapsed / generated positions,
prefill included); ideal ms = (weight bytes + KV bytes the step reads) / HBM bandwidth, with the
bandwidth measured by a large device-to-device copy (bytes read + written); meas/ideal.
On CUDA each kvserve system also profiles one request of --profile-tokens new tokens
(torch.profiler): kernel time vs wall time per step and the top kernels, i.e. where the time
beyond the roofline goes (JSON `<system>_profile`).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_engine import left_pad
from benchmarks.llama_shapes import (
    LLAMA_SHAPES,
    kv_bytes_per_token,
    weight_bytes_per_step,
    write_llama_checkpoint,
)
from kvserve.engine.worker.device import resolve_device

# (number of requests, prompt length range, output length range); ranges inclusive
CASES = {
    "a": (1, (128, 128), (256, 256)),
    "b": (64, (1024, 1024), (256, 256)),
    "c": (256, (64, 2048), (32, 512)),
}
SMALL_CASES = {"a": (1, (16, 16), (8, 8)), "b": (4, (32, 32), (8, 8)), "c": (8, (8, 64), (4, 16))}


def make_case(
    name: str, vocab_size: int, small: bool, seed: int
) -> tuple[list[list[int]], list[int]]:
    table = SMALL_CASES if small else CASES
    if name not in table:
        raise ValueError(f"unknown case {name!r}: one of {sorted(table)}")
    num, (p_lo, p_hi), (o_lo, o_hi) = table[name]
    rng = np.random.default_rng(seed)
    lens = rng.integers(p_lo, p_hi + 1, num).tolist()
    outs = rng.integers(o_lo, o_hi + 1, num).tolist()
    return [rng.integers(3, vocab_size, n).tolist() for n in lens], outs


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy, counting the bytes read and the bytes written."""
    if nbytes is None:
        nbytes = 1 << 30 if device.type == "cuda" else 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    synchronize(device)
    elapsed = time.perf_counter() - start
    del src, dst
    return 2 * nbytes * iters / elapsed


class StepTimer:
    """Times each `runner.execute` (it ends in the step's sync) and what the step reads."""

    def __init__(self, runner) -> None:
        self.runner, self.original = runner, runner.execute
        self.steps: list[
            tuple[float, bool, int]
        ] = []  # (seconds, decode-only, context tokens read)
        runner.execute = self._execute

    def _execute(self, record, *args):
        start = time.perf_counter()
        out = self.original(record, *args)
        elapsed = time.perf_counter() - start
        is_decode = all(n == 1 for n in record.num_scheduled_tokens)
        context = sum(
            c + n for c, n in zip(record.num_computed_tokens, record.num_scheduled_tokens)
        )
        self.steps.append((elapsed, is_decode, context))
        return out

    def remove(self) -> None:
        self.runner.execute = self.original


def roofline(
    decode_steps: list[tuple[float, bool, int]],
    weight_bytes: int,
    kv_per_token: int,
    bandwidth: float,
) -> dict:
    if not decode_steps:
        return dict(
            num_decode_steps=0, ms_per_step=None, ideal_ms_per_step=None, measured_over_ideal=None
        )
    measured = sum(s[0] for s in decode_steps)
    ideal = sum((weight_bytes + s[2] * kv_per_token) / bandwidth for s in decode_steps)
    n = len(decode_steps)
    return dict(
        num_decode_steps=n,
        ms_per_step=1e3 * measured / n,
        ideal_ms_per_step=1e3 * ideal / n,
        measured_over_ideal=measured / ideal,
    )


def run_kvserve(
    llm,
    prompts: list[list[int]],
    outs: list[int],
    weight_bytes: int,
    kv_per_token: int,
    bandwidth: float,
) -> dict:
    from kvserve.engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    timer = StepTimer(llm.engine.runner)
    try:
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        timer.remove()
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    if produced != sum(outs):
        raise RuntimeError(f"kvserve produced {produced} tokens, {sum(outs)} were asked for")
    decode = [s for s in timer.steps if s[1]]
    return dict(
        tok_s=produced / elapsed,
        elapsed_s=elapsed,
        num_steps=len(timer.steps),
        **roofline(decode, weight_bytes, kv_per_token, bandwidth),
    )


def profile_kvserve(llm, vocab_size: int, prompt_len: int, num_tokens: int, top: int = 15) -> dict:
    """Where a batch-1 decode step's time goes: torch.profiler over one request (CPU + CUDA).
    Kernel time per step vs wall time per step; the gap is the GPU waiting on the host."""
    from torch.profiler import ProfilerActivity, profile

    from kvserve.engine import SamplingParams

    prompt = np.random.default_rng(7).integers(3, vocab_size, prompt_len).tolist()
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    timer = StepTimer(llm.engine.runner)
    try:
        with profile(activities=activities) as prof:
            llm.generate([prompt], params, use_tqdm=False)
    finally:
        timer.remove()
    decode_s = sum(s[0] for s in timer.steps if s[1])
    num_decode = sum(1 for s in timer.steps if s[1])
    events = [e for e in prof.key_averages() if str(e.device_type).endswith("CUDA")]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    steps = len(timer.steps)
    kernel_us = sum(e.self_device_time_total for e in events)
    return dict(
        num_steps=steps,
        decode_wall_ms_per_step=1e3 * decode_s / max(num_decode, 1),
        kernel_ms_per_step=kernel_us / 1e3 / steps,
        num_kernels_per_step=sum(e.count for e in events) / steps,
        top_kernels=[
            dict(
                name=e.key[:120],
                ms_per_step=e.self_device_time_total / 1e3 / steps,
                calls_per_step=e.count / steps,
            )
            for e in events[:top]
        ],
    )


def hf_batches(prompts: list[list[int]], outs: list[int], batch_size: int):
    for i in range(0, len(prompts), batch_size):
        yield prompts[i : i + batch_size], outs[i : i + batch_size]


@torch.inference_mode()
def run_hf(
    model,
    prompts: list[list[int]],
    outs: list[int],
    batch_size: int,
    budget_s: float,
    weight_bytes: int,
    kv_per_token: int,
    bandwidth: float,
    static_cache: bool = False,
) -> dict:
    """Static batches in arrival order, left-padded; counts only the requested tokens. Stops starting
    batches once `budget_s` is spent (at least one runs)."""
    device = model.device
    produced = steps = 0
    elapsed = ideal = 0.0
    num_batches = 0
    total_batches = -(-len(prompts) // batch_size)
    kw = dict(cache_implementation="static") if static_cache else dict(disable_compile=True)
    for batch, wanted in hf_batches(prompts, outs, batch_size):
        if num_batches and elapsed >= budget_s:
            break
        ids, mask = (t.to(device) for t in left_pad(batch))
        width, new = ids.shape[1], max(wanted)
        synchronize(device)
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
        synchronize(device)
        elapsed += time.perf_counter() - start
        produced += sum(wanted)
        steps += new
        num_batches += 1
        # each step reads the weights and every row's padded cache so far
        ideal += (
            sum(weight_bytes + len(batch) * (width + j + 1) * kv_per_token for j in range(new))
            / bandwidth
        )
    return dict(
        tok_s=produced / elapsed,
        elapsed_s=elapsed,
        num_steps=steps,
        ms_per_step=1e3 * elapsed / steps,
        ideal_ms_per_step=1e3 * ideal / steps,
        measured_over_ideal=elapsed / ideal,
        batch_size=batch_size,
        num_batches=num_batches,
        total_batches=total_batches,
        output_tokens_run=produced,
    )


def free_memory(device: torch.device) -> int | None:
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="llama-1b", choices=sorted(LLAMA_SHAPES))
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--cases", default="a,b,c", help="comma-separated subset of a,b,c")
    p.add_argument("--small", action="store_true", help="shrunk cases (CPU smoke tests)")
    p.add_argument(
        "--model-dir",
        help="checkpoint folder (default bench_out/models/<shape>); reused if complete",
    )
    p.add_argument("--out", help="JSON results (default bench_out/bench_gpu_<shape>.json)")
    p.add_argument(
        "--eager-cases", default="a", help="cases also run with enforce_eager=True ('' for none)"
    )
    p.add_argument("--skip-hf", default="", help="cases for which transformers is not run, e.g. c")
    p.add_argument(
        "--hf-compile-cases",
        default=None,
        help="cases run with transformers' static cache + torch.compile (default a on CUDA, none on CPU)",
    )
    p.add_argument("--hf-batch", type=int, default=32, help="transformers' static batch for case c")
    p.add_argument(
        "--hf-budget-s",
        type=float,
        default=60.0,
        help="seconds of transformers runs per case, at most",
    )
    p.add_argument(
        "--profile-tokens",
        type=int,
        default=None,
        help="profile one request of --profile-tokens new tokens per kvserve system (default 64 on "
        "CUDA, 0 = off on CPU)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantization",
        default=None,
        choices=["none", "int8", "int4", "fp8"],
        help="the engine's weights (Triton weight-only kernel on CUDA); transformers stays bf16",
    )
    return p


def _case_list(text: str) -> list[str]:
    return [c for c in text.split(",") if c]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cases = _case_list(args.cases)
    table = SMALL_CASES if args.small else CASES
    for group in (
        cases,
        _case_list(args.eager_cases),
        _case_list(args.skip_hf),
        _case_list(args.hf_compile_cases or ""),
    ):
        bad = [c for c in group if c not in table]
        if bad:
            parser.error(f"unknown case(s) {bad}: choose from {sorted(table)}")
    if args.hf_batch < 1 or args.hf_budget_s <= 0:
        parser.error(
            f"--hf-batch must be >= 1 and --hf-budget-s > 0, got {args.hf_batch} and {args.hf_budget_s}"
        )
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        parser.error(f"--device {args.device}: {exc} (use --device cpu)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    compile_cases = _case_list(
        args.hf_compile_cases
        if args.hf_compile_cases is not None
        else ("a" if device.type == "cuda" else "")
    )
    profile_tokens = (
        args.profile_tokens
        if args.profile_tokens is not None
        else (64 if device.type == "cuda" else 0)
    )
    model_dir = Path(args.model_dir or f"bench_out/models/{args.shape}")
    out_path = Path(args.out or f"bench_out/bench_gpu_{args.shape}.json")

    start = time.perf_counter()
    write_llama_checkpoint(model_dir, args.shape, device=str(device))
    checkpoint_s = time.perf_counter() - start
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    weight_bytes, kv_per_token = weight_bytes_per_step(config), kv_bytes_per_token(config)
    bandwidth = measure_bandwidth(device)
    workloads = {c: make_case(c, config.vocab_size, args.small, args.seed) for c in cases}
    max_model_len = (
        max(len(p) + o for prompts, outs in workloads.values() for p, o in zip(prompts, outs)) + 1
    )
    results = {
        "shape": args.shape,
        "config": LLAMA_SHAPES[args.shape],
        "device": args.device,
        "device_name": (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor() or platform.machine()
        ),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": "bfloat16",
        "small": args.small,
        "checkpoint_s": checkpoint_s,
        "hbm_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "cases": {},
        "errors": {},
    }
    print(
        f"{args.shape} on {results['device_name']}: bandwidth {bandwidth / 1e9:.0f} GB/s (copy, read + write); "
        f"weights {weight_bytes / 1e9:.2f} GB/step, KV {kv_per_token / 1e3:.1f} kB/token; "
        f"checkpoint {checkpoint_s:.1f} s",
        flush=True,
    )
    for c, (prompts, outs) in workloads.items():
        results["cases"][c] = dict(
            num_requests=len(prompts),
            prompt_tokens=sum(map(len, prompts)),
            output_tokens=sum(outs),
            systems={},
        )

    def record(case: str, system: str, fn) -> None:
        try:
            row = fn()
        except Exception as exc:  # a failing system is reported, the others still run
            traceback.print_exc()
            row = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            results["errors"][f"{case}/{system}"] = row["error"]
        results["cases"][case]["systems"][system] = row
        print_row(case, system, results["cases"][case], row)
        write_json(out_path, results)

    engine_kw = dict(
        dtype="bfloat16",
        device=args.device,
        max_model_len=max_model_len,
        quantization=args.quantization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    print_header()
    for eager in (False, True):
        run_cases = [c for c in cases if not eager or c in _case_list(args.eager_cases)]
        if not run_cases:
            continue
        name = "kvserve-eager" if eager else "kvserve"
        llm = _load_engine(model_dir, engine_kw, eager, results, name)
        if llm is None:
            continue
        if args.quantization not in (
            None,
            "none",
        ):  # the roofline reads the quantized bytes the model holds
            weight_bytes = llm.engine.info.weight_bytes
        _warm_engine(llm, config.vocab_size)
        for c in run_cases:
            record(
                c,
                name,
                lambda c=c, llm=llm: run_kvserve(
                    llm, *workloads[c], weight_bytes, kv_per_token, bandwidth
                ),
            )
        if profile_tokens:
            try:
                results[f"{name}_profile"] = prof = profile_kvserve(
                    llm, config.vocab_size, 16 if args.small else 128, profile_tokens
                )
                print_profile(name, prof)
            except Exception as exc:  # the profile is a diagnosis: never fatal
                traceback.print_exc()
                results["errors"][f"profile/{name}"] = f"{type(exc).__name__}: {exc}"[:2000]
            write_json(out_path, results)
        _release_engine(llm)
        del llm
        results[f"{name}_memory_after_free"] = free_memory(device)

    hf_cases = [c for c in cases if c not in _case_list(args.skip_hf)]
    if hf_cases or compile_cases:
        hf = _load_hf(model_dir, device, results)
        if hf is not None:
            for c in hf_cases:
                batch = 1 if c == "a" else (len(workloads[c][0]) if c == "b" else args.hf_batch)
                record(
                    c,
                    "hf-eager",
                    lambda c=c, batch=batch: run_hf(
                        hf,
                        *workloads[c],
                        batch,
                        args.hf_budget_s,
                        weight_bytes,
                        kv_per_token,
                        bandwidth,
                    ),
                )
            for c in [c for c in compile_cases if c in workloads]:
                batch = 1 if c == "a" else (len(workloads[c][0]) if c == "b" else args.hf_batch)
                record(
                    c,
                    "hf-compile",
                    lambda c=c, batch=batch: _run_hf_compiled(
                        hf,
                        workloads[c],
                        batch,
                        args.hf_budget_s,
                        weight_bytes,
                        kv_per_token,
                        bandwidth,
                    ),
                )
            del hf
            free_memory(device)
    write_json(out_path, results)
    print(f"results in {out_path}")
    return 0


def _load_engine(model_dir: Path, engine_kw: dict, eager: bool, results: dict, name: str):
    from kvserve.engine import LLM

    start = time.perf_counter()
    try:
        llm = LLM(str(model_dir), **engine_kw, enforce_eager=eager)
    except Exception as exc:
        traceback.print_exc()
        results["errors"][f"load/{name}"] = f"{type(exc).__name__}: {exc}"[:2000]
        return None
    info = llm.engine.info
    results[f"{name}_load_s"] = time.perf_counter() - start
    results[f"{name}_info"] = dict(
        attention_backend=info.attention_backend,
        cuda_graphs=info.cuda_graphs,
        num_kv_blocks=info.num_kv_blocks,
        kv_capacity_tokens=info.kv_capacity_tokens,
    )
    print(
        f"{name}: loaded in {results[f'{name}_load_s']:.1f} s, attention {info.attention_backend}, "
        f"CUDA graphs {info.cuda_graphs}, KV cache {info.kv_capacity_tokens} tokens",
        flush=True,
    )
    return llm


def _release_engine(llm) -> None:
    """Drop the engine's device memory explicitly (KV pool, CUDA graphs, weights), so the next
    system gets the GPU even if something still refers to the engine."""
    runner = llm.engine.runner
    for layer in runner.attn_layers:
        layer.kv_cache = None
    runner.graphs = None
    runner.model = None


def _warm_engine(llm, vocab_size: int) -> None:
    """Kernel builds and autotuning happen here, not in the first timed case."""
    from kvserve.engine import SamplingParams

    rng = np.random.default_rng(123)
    longest = llm.engine.info.max_model_len - 9
    prompts = [rng.integers(3, vocab_size, min(n, longest)).tolist() for n in (5, 70, 33, 9)]
    llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )


def _load_hf(model_dir: Path, device: torch.device, results: dict):
    import transformers

    start = time.perf_counter()
    try:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.bfloat16, device_map=str(device)
            )
        except (ImportError, ValueError):  # no accelerate: load on the host, then move
            model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.bfloat16
            ).to(device)
    except Exception as exc:
        traceback.print_exc()
        results["errors"]["load/hf"] = f"{type(exc).__name__}: {exc}"[:2000]
        return None
    results["hf_load_s"] = time.perf_counter() - start
    model.eval()
    warm = [[5] * 16]
    run_hf(model, warm, [4], 1, 1e9, 1, 1, 1.0)
    return model


def _run_hf_compiled(
    model,
    workload,
    batch: int,
    budget_s: float,
    weight_bytes: int,
    kv_per_token: int,
    bandwidth: float,
) -> dict:
    prompts, outs = workload
    start = time.perf_counter()
    first = list(hf_batches(prompts, outs, batch))[0]  # compiles for this batch's shapes
    run_hf(model, first[0], first[1], batch, 1e9, 1, 1, 1.0, static_cache=True)
    compile_s = time.perf_counter() - start
    row = run_hf(
        model,
        prompts,
        outs,
        batch,
        budget_s,
        weight_bytes,
        kv_per_token,
        bandwidth,
        static_cache=True,
    )
    return dict(row, compile_s=compile_s)


COLUMNS = (
    f"{'case':4} {'system':14} {'reqs':>5} {'out tok':>8} {'tok/s':>9} {'ms/step':>8} {'ideal ms':>8} "
    f"{'meas/ideal':>10}"
)


def print_header() -> None:
    print(COLUMNS, flush=True)


def print_row(case: str, system: str, case_info: dict, row: dict) -> None:
    if "error" in row:
        print(f"{case:4} {system:14} error: {row['error'][:200]}", flush=True)
        return

    def num(key: str, fmt: str) -> str:
        value = row.get(key)
        return format(value, fmt) if value is not None else "n/a"

    partial = (
        ""
        if row.get("num_batches", 1) == row.get("total_batches", 1)
        else f"  ({row['num_batches']} of {row['total_batches']} batches of {row['batch_size']})"
    )
    print(
        f"{case:4} {system:14} {case_info['num_requests']:5d} {case_info['output_tokens']:8d} "
        f"{num('tok_s', '9.1f')} {num('ms_per_step', '8.2f')} {num('ideal_ms_per_step', '8.2f')} "
        f"{num('measured_over_ideal', '10.2f')}{partial}",
        flush=True,
    )


def print_profile(name: str, prof: dict) -> None:
    print(
        f"{name} profile, batch 1: wall {prof['decode_wall_ms_per_step']:.2f} ms per decode step, kernels "
        f"{prof['kernel_ms_per_step']:.2f} ms per step ({prof['num_kernels_per_step']:.0f} launches per step)",
        flush=True,
    )
    for k in prof["top_kernels"]:
        print(
            f"    {k['ms_per_step']:8.3f} ms/step {k['calls_per_step']:6.1f}x  {k['name']}",
            flush=True,
        )


def write_json(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
