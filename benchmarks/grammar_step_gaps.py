"""Step gaps of a running stream while a large grammar compiles, in-process, for source trees side by side.

One `LLMEngine` per run (a child process with the tree on PYTHONPATH) on the SmolLM-shaped
random checkpoint: one unconstrained request decodes (ignore_eos) while a constrained request
with `--tools` realistic tools under tool_choice "required" (or `--schema props:N`, N optional
string properties) waits for its grammar. Reports the step durations while the grammar compiles
(each step is one token of the stream: its inter-token gap) against the steps just before, and
how long the compile took. Runs alternate between the trees, `--rounds` times. A tree given as
NAME=PATH:NICE runs its compile threads at that nice value (trees with engine/structured_output/compile_threads.py).

    git archive 393ee78 | tar -x -C /tmp/base
    python benchmarks/grammar_step_gaps.py --tree base=/tmp/base --tree new=. --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

MODEL = "loadtest_out/models/smollm-135m-random"
HERE = os.path.dirname(os.path.abspath(__file__))


def _schema(what: str, tag: str) -> dict:
    sys.path.insert(0, HERE)
    from grammar_contention import tool  # noqa: E402

    from kvserve.server.tool_parsers import forced_schema  # noqa: E402

    kind, _, n = what.partition(":")
    if kind == "tools":
        return forced_schema([tool(f"f{tag}_{i}") for i in range(int(n))], "required")
    return {
        "type": "object",
        "properties": {f"{tag}{i}": {"type": "string"} for i in range(int(n))},
    }


def child(model: str, what: str, nice: str) -> None:
    from kvserve.engine import SamplingParams, StructuredOutputs
    from kvserve.engine.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine

    is_base = nice == "base"  # a tree without compile time limits or nice compile threads
    kwargs = {} if is_base else {"grammar_compile_timeout_s": 3600.0}  # measure the whole compile
    engine = LLMEngine(EngineArgs(model=model, device="cpu", dtype="float32", **kwargs))
    if not is_base and nice != "default":
        engine.structured._pool.nice = int(nice)
    engine.add_request(
        "stream", "Once upon a time", SamplingParams(max_tokens=1900, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    engine.structured._get_compiler()  # the tokenizer tables, built once per engine: not part of the figure
    before = []
    for _ in range(20):
        t = time.perf_counter()
        engine.step()
        before.append(time.perf_counter() - t)
    spec = StructuredOutputs(json=_schema(what, uuid.uuid4().hex[:6]))
    engine.add_request("big", "hi", SamplingParams(max_tokens=1, structured_outputs=spec))
    start, during = time.perf_counter(), []
    while engine.structured.has_pending:
        t = time.perf_counter()
        engine.step()
        during.append(time.perf_counter() - t)
    print(
        json.dumps(
            {
                "compile_wait_s": round(time.perf_counter() - start, 2),
                "step_ms_before_median": round(1000 * statistics.median(before), 1),
                "step_ms_during_median": round(1000 * statistics.median(during), 1)
                if during
                else None,
                "step_ms_during_max": round(1000 * max(during), 1) if during else None,
                "num_steps_during": len(during),
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH or NAME=PATH:NICE")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--what", default="tools:128", help="tools:N or props:N")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, what, nice = args.child
        child(model, what, nice)
        return
    print(f"# {os.cpu_count()} CPUs, {args.what}", flush=True)
    for rnd in range(args.rounds):
        for item in args.tree:
            name, _, rest = item.partition("=")
            path, _, nice = rest.partition(":")
            is_base = not os.path.exists(os.path.join(path, "engine", "grammar_compile.py"))
            nice_arg = "base" if is_base else (nice or "default")
            env = {**os.environ, "PYTHONPATH": os.path.abspath(path)}
            load = os.getloadavg()[0]
            out = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--child",
                    os.path.abspath(args.model),
                    args.what,
                    nice_arg,
                ],
                cwd=path,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]
            print(
                json.dumps(
                    {
                        "round": rnd,
                        "tree": name,
                        "nice": nice_arg,
                        "load_before": round(load, 2),
                        **(json.loads(line) if line.startswith("{") else {"error": line}),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
