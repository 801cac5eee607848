"""Structured outputs: what a JSON-schema constraint costs the engine, and what a large schema costs to compile.

    python -m benchmarks.bench_structured [--dtype bfloat16] [--threads 2] [--repeats 3]

On the SmolLM-135M-shaped random Llama (benchmarks/smollm_checkpoint.py; 49,152-token
vocabulary), 64 requests, prompt 128, 128 new tokens, greedy, run alternately:
  plain        no constraint (bench_engine's case b)
  json_schema* every request constrained by a JSON schema whose output cannot end within
               128 tokens (an array of at least 1,000 items), so every run produces exactly
               the same number of tokens; the items are strings (json_schema), strings of
               at most 12 characters (json_schema_bounded) or small objects with an integer
               range, an enum and an optional boolean (json_schema_mixed)
Reports output tokens/s (medians over --repeats), each constrained case's share of the plain
one (the median over repeats of constrained / plain of the same repeat), and where the
constrained run's extra time goes: filling the bitmasks (core process, per step) and applying
them to the logits (runner, per step).
Then the compile time of a large schema (200 properties of every kind) and of a medium one
(60), cold (a fresh compiler, tokenizer tables included) and from the cache.
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


def long_schema(item: dict) -> dict:
    """An object holding an array of at least 1,000 `item`s: its output cannot end within 128 tokens."""
    return {
        "type": "object",
        "required": ["items"],
        "properties": {"items": {"type": "array", "items": item, "minItems": 1000}},
    }


# the constrained cases: what the items of the array are
CASES = {
    "json_schema": long_schema(
        {"type": "string"}
    ),  # strings: most tokens allowed, masks mostly precomputed
    "json_schema_bounded": long_schema({"type": "string", "maxLength": 12}),  # xgrammar's slow case
    "json_schema_mixed": long_schema(
        {
            "type": "object",
            "required": ["id", "tag"],
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                "tag": {"enum": ["red", "green", "blue"]},
                "ok": {"type": "boolean"},
            },
        }
    ),
}


def big_schema(num_properties: int) -> dict:
    """Objects, integers with ranges, enums, bounded arrays, patterns and anyOf, half of them required."""
    props = {}
    for i in range(num_properties):
        kind = i % 6
        if kind == 0:
            props[f"s{i}"] = {"type": "string", "maxLength": 20}
        elif kind == 1:
            props[f"n{i}"] = {"type": "integer", "minimum": 0, "maximum": 1000}
        elif kind == 2:
            props[f"e{i}"] = {"enum": ["red", "green", "blue", f"c{i}"]}
        elif kind == 3:
            props[f"a{i}"] = {
                "type": "array",
                "items": {"type": "number"},
                "minItems": 1,
                "maxItems": 4,
            }
        elif kind == 4:
            props[f"o{i}"] = {
                "type": "object",
                "required": ["x"],
                "properties": {
                    "x": {"type": "boolean"},
                    "y": {"type": "string", "pattern": "^[a-z]{2,5}$"},
                },
            }
        else:
            props[f"u{i}"] = {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "integer"}]}
    return {"type": "object", "properties": props, "required": list(props)[: num_properties // 2]}


class _Timer:
    """Wraps a callable and sums the time spent in it."""

    def __init__(self, fn) -> None:
        self.fn, self.total_s, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total_s += time.perf_counter() - start
            self.calls += 1


def run(llm, prompts: list[list[int]], max_tokens: int, schema: dict | None) -> float:
    from kvserve.engine import SamplingParams
    from kvserve.engine.sampling_params import StructuredOutputs

    spec = StructuredOutputs(json=schema) if schema is not None else None
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=spec
    )
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    assert produced == max_tokens * len(prompts), (produced, max_tokens * len(prompts))
    if schema is not None:
        assert results[0].outputs[0].text.startswith('{"items": ['), results[0].outputs[0].text[:40]
    return produced / elapsed


def compile_times(llm, schema: dict) -> tuple[float, float]:
    """(cold, cached) seconds to get the compiled grammar of `schema`."""
    from kvserve.engine.config import EngineArgs
    from kvserve.engine.sampling_params import StructuredOutputs
    from kvserve.engine.structured_output.grammar import StructuredOutputManager

    info = llm.engine.info
    manager = StructuredOutputManager(
        llm.tokenizer, info.vocab_size, info.eos_token_ids, EngineArgs().structured_outputs_config()
    )
    spec = StructuredOutputs(json=schema)
    start = time.perf_counter()
    manager._compiled(spec).result()
    cold = time.perf_counter() - start
    start = time.perf_counter()
    manager._compiled(StructuredOutputs(json=json.loads(json.dumps(schema)))).result()
    return cold, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", default="loadtest_out/models/smollm-135m-random")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each, alternating; medians are reported"
    )
    parser.add_argument("--out", default="bench_out/bench_structured.json")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    torch.set_num_threads(args.threads)
    model_dir = str(build_smollm_like(args.model_dir))
    from kvserve.engine import LLM

    llm = LLM(model_dir, dtype=args.dtype, device=args.device, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    vocab = llm.engine.info.vocab_size
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.num_requests)]
    run(llm, prompts[:2], 8, None)
    for schema in CASES.values():
        run(llm, prompts[:2], 8, schema)  # compiles the schemas, builds the control-byte mask

    fill = llm.engine.structured.step_bitmask = _Timer(llm.engine.structured.step_bitmask)
    apply = llm.engine.runner.logits_processors = _Timer(llm.engine.runner.logits_processors)
    runs: dict[str, list[float]] = {"plain": [], **{name: [] for name in CASES}}
    per_step: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeats):
        runs["plain"].append(run(llm, prompts, args.max_tokens, None))
        for name, schema in CASES.items():
            fill.total_s = apply.total_s = fill.calls = apply.calls = 0
            runs[name].append(run(llm, prompts, args.max_tokens, schema))
            per_step[name] = (
                fill.total_s / max(fill.calls, 1) * 1e3,
                apply.total_s / max(apply.calls, 1) * 1e3,
            )
    medians = {name: statistics.median(r) for name, r in runs.items()}
    # each repeat's constrained runs against that repeat's plain run (seconds apart): steadier on a
    # shared machine than a ratio of medians taken minutes apart
    ratios = {
        name: statistics.median(c / p for c, p in zip(runs[name], runs["plain"])) for name in CASES
    }
    print(
        f"{args.num_requests} requests x {args.max_tokens} tokens, prompt {args.prompt_len}, {args.dtype}, "
        f"{args.threads} threads"
    )
    for name, r in runs.items():
        extra = (
            ""
            if name == "plain"
            else (
                f" = {ratios[name]:6.1%} of plain (median of per-repeat ratios); per step (last run): "
                f"bitmask fill {per_step[name][0]:.2f} ms, apply {per_step[name][1]:.2f} ms"
            )
        )
        print(
            f"  {name:20s} {medians[name]:7.1f} tok/s (runs {' / '.join(f'{x:.1f}' for x in r)}){extra}"
        )

    compile_results = {}
    for num_properties in (60, 200):
        cold, cached = compile_times(llm, big_schema(num_properties))
        compile_results[num_properties] = dict(cold_s=cold, cached_s=cached)
        print(
            f"  compile a {num_properties}-property schema: cold {cold:.3f} s, cached {cached * 1e3:.3f} ms"
        )

    results = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "tok_s": medians,
        "runs": runs,
        "ratio_to_plain": ratios,
        "fill_apply_ms_per_step": per_step,
        "compile": compile_results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
