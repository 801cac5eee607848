"""The host's work per engine step, with a model that costs nothing.

    python -m benchmarks.bench_host_overhead [--model-dir DIR] [--batch-sizes 1,16,64,256]
        [--steps 200] [--mixed-every 8] [--mixed-prompt 512] [--device cpu|cuda]
        [--stream-mib 0] [--out bench_out/bench_host_overhead.json]

The real engine loop (scheduler and block manager, input staging, sampler, output processing
with the detokenizer) runs over a stub forward that returns preallocated tensors of the real
shapes ([T, hidden] hidden states, [N, vocab] logits): what is timed is what the host adds to
every step, on any device. For each batch size B, B requests (16-token prompts, greedy, EOS
ignored) are admitted and prefilled, then `--steps` steps in which all B rows decode are timed;
the "mixed" run does the same with a `--mixed-prompt`-token prompt arriving every
`--mixed-every` steps (chunked beside the decodes). Prints microseconds per step, median over
the steps, in total and by phase: schedule, inputs (the runner's flat step tensors), forward
(the stub, ~0), sampler (its argmax over the vocabulary is host work on the CPU, device work on
a GPU), outputs (scheduler update, stop checks, detokenizing, deltas) and the rest of the step.
A step is `LLMEngine.step_deltas`, the engine core's loop (the offline `LLM` also folds deltas
into outputs; the server does that in its own process).
Without `--model-dir` it writes the SmolLM-135M-shaped random checkpoint of
benchmarks/smollm_checkpoint.py (49,152-token vocabulary) to loadtest_out/models/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.smollm_checkpoint import build_smollm_like

SMOLLM_DIR = "loadtest_out/models/smollm-135m-random"
PROMPT_LEN = 16
PHASES = ("schedule", "inputs", "forward", "sampler", "outputs", "rest")


class StubForward:
    """The runner's forward and LM head, returning slices of tensors made once (grown on demand)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: str,
        stream_mib: int = 0,
    ) -> None:
        # read before each forward, as a real one streams its weights through the caches
        self.stream = torch.ones(stream_mib * 2**18, device=device) if stream_mib else None
        self.hidden_size, self.vocab_size, self.dtype, self.device = (
            hidden_size,
            vocab_size,
            dtype,
            device,
        )
        self.hidden = torch.zeros(0, hidden_size, dtype=dtype, device=device)
        self.logits = torch.zeros(0, vocab_size, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        if self.stream is not None:
            self.stream.sum()
        rows = input_ids.shape[0]
        if self.hidden.shape[0] < rows:
            self.hidden = torch.zeros(rows, self.hidden_size, dtype=self.dtype, device=self.device)
        return self.hidden[:rows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if self.logits.shape[0] < rows:  # random rows: each request samples its own tokens
            g = torch.Generator().manual_seed(rows)
            self.logits = torch.randn(rows, self.vocab_size, generator=g).to(
                self.device, self.dtype
            )
        return self.logits[:rows]


class PhaseClock:
    """Seconds per phase within the current step; `wrap` times one callable into a phase."""

    def __init__(self) -> None:
        self.current = dict.fromkeys(PHASES, 0.0)
        self.steps: list[dict[str, float]] = []

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - start

        return timed

    def step(self, engine: Any) -> None:
        self.current = dict.fromkeys(PHASES, 0.0)
        start = time.perf_counter()
        engine.step_deltas()  # the engine core's loop (LLM.generate also folds the deltas)
        total = time.perf_counter() - start
        self.current["rest"] = total - sum(self.current.values())
        self.steps.append({**self.current, "total": total})


def install(llm: Any, clock: PhaseClock, device: str, stream_mib: int = 0) -> None:
    """The stub in place of the model's forward, clocks around the engine's phases."""
    engine, runner = llm.engine, llm.engine.runner
    config = runner.model.config
    stub = StubForward(config.hidden_size, config.vocab_size, runner.dtype, device, stream_mib)
    runner.graphs = None  # on a GPU: the stub runs eagerly (nothing to capture)
    runner.cpu_stack = clock.wrap("forward", stub.forward)
    runner.model.compute_logits = clock.wrap("forward", stub.compute_logits)
    runner._prepare_inputs = clock.wrap("inputs", runner._prepare_inputs)
    runner.sampler = clock.wrap("sampler", runner.sampler)
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update = clock.wrap("outputs", engine.scheduler.update)
    engine.output_processor.process = clock.wrap("outputs", engine.output_processor.process)


def run(llm: Any, clock: PhaseClock, batch: int, steps: int, mixed: tuple[int, int] | None) -> dict:
    """Median microseconds per phase over `steps` timed steps with `batch` decoding rows."""
    from kvserve.engine import SamplingParams

    engine = llm.engine
    vocab = llm.engine.info.vocab_size
    rng = np.random.default_rng(batch)
    tag = f"b{batch}-{'mixed' if mixed else 'decode'}"
    # long enough to decode through every timed step (a step may hold no decode row of some requests)
    max_tokens = min(steps + 64, llm.engine.info.max_model_len - PROMPT_LEN)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", rng.integers(3, vocab, PROMPT_LEN).tolist(), params)
    while engine.stats().num_waiting:  # admitted
        engine.step()
    for _ in range(4):  # every prompt computed: all rows decode
        engine.step()
    clock.steps.clear()
    arrivals = 0
    for s in range(steps):
        if mixed is not None and s % mixed[0] == 0:
            one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            engine.add_request(f"{tag}-p{arrivals}", rng.integers(3, vocab, mixed[1]).tolist(), one)
            arrivals += 1
        clock.step(engine)
    for request_id in [f"{tag}-{i}" for i in range(batch)]:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        phase: 1e6 * statistics.median(step[phase] for step in clock.steps)
        for phase in (*PHASES, "total")
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_host_overhead", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--model-dir", help="a checkpoint (default: the SmolLM-shaped random one, written once)"
    )
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--mixed-every", type=int, default=8, help="0: no mixed runs")
    p.add_argument("--mixed-prompt", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--stream-mib",
        type=int,
        default=0,
        help="the stub's forward first reads this many MiB (its time counts in 'forward'), as a real "
        "forward streams the weights: the host's work then finds its own objects evicted",
    )
    p.add_argument("--out", default="bench_out/bench_host_overhead.json")
    args = p.parse_args(argv)
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if (
        min(sizes) < 1
        or args.steps < 1
        or args.mixed_every < 0
        or args.mixed_prompt < 1
        or args.stream_mib < 0
    ):
        p.error(
            "batch sizes, --steps and --mixed-prompt must be >= 1, --mixed-every and --stream-mib >= 0"
        )

    from kvserve.engine import LLM

    model_dir = args.model_dir or build_smollm_like(SMOLLM_DIR)
    llm = LLM(
        str(model_dir),
        device=args.device,
        max_num_seqs=max(sizes) + 1,
        enable_prefix_caching=False,
    )
    if args.steps + 8 + PROMPT_LEN > llm.engine.info.max_model_len:
        p.error(f"--steps {args.steps}: the requests would outgrow the model's context")
    clock = PhaseClock()
    install(llm, clock, args.device, args.stream_mib)
    results = []
    print(
        f"host work per step on {llm.engine.info.device}, microseconds (median of {args.steps} steps)"
    )
    print(f"{'rows':>5} {'kind':>7} " + " ".join(f"{ph:>9}" for ph in (*PHASES, "total")))
    for batch in sizes:
        kinds = [("decode", None)] + (
            [("mixed", (args.mixed_every, args.mixed_prompt))] if args.mixed_every else []
        )
        for kind, mixed in kinds:
            us = run(llm, clock, batch, args.steps, mixed)
            results.append({"rows": batch, "kind": kind, **us})
            print(
                f"{batch:>5} {kind:>7} " + " ".join(f"{us[ph]:9.1f}" for ph in (*PHASES, "total"))
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"device": str(llm.engine.info.device), "results": results}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
