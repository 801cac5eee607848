"""Speculative decoding (n-gram prompt lookup) against none, offline, side by side in one run.

    python -m benchmarks.bench_spec [--model DIR] [--ks 2,4,8] [--batch-sizes 1,64] [--rounds 2]
        [--input-len 128] [--output-len 128] [--temperature 0] [--quantization Q] [--out FILE]

For each batch size, each round runs speculation off and then each K (alternating, one engine
each), every request with a random prompt (seeded, the same for every configuration) and EOS
ignored. Prints decode tok/s (output tokens after each request's first, over the time after the
first token of the batch), the draft acceptance rate and the mean accepted drafts per verification.

What the acceptance means depends on the model: the default checkpoint has random weights, whose
greedy continuations fall into repeating loops (prompt lookup then finds them: acceptance near 1),
while sampling at temperature 1 from its near-uniform distribution repeats nothing (acceptance
near 0, and drafts are rarely even proposed). Those are the two ends the policy must handle.
`--adversarial` replaces the drafts with tokens that are (almost) never right, proposed at every
chance: the cost of rejected drafts, with the back-off that limits it.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.spec_decode import proposer as spec_decode


def run_once(
    model: str,
    spec: dict | None,
    prompts: list[list[int]],
    params: SamplingParams,
    quantization: str | None,
) -> dict:
    llm = LLM(
        model, speculative_config=spec, quantization=quantization, max_num_seqs=max(len(prompts), 1)
    )
    engine = llm.engine
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([prompts[0][:16]], warm, use_tqdm=False)  # first-use costs out of the timing
    sched = engine.scheduler
    drafts0, accepted0, verif0 = (
        sched.num_draft_tokens,
        sched.num_accepted_tokens,
        sched.num_verifications,
    )
    generated0 = engine.stats().generation_tokens_total
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", {"prompt_token_ids": prompt}, params)
    start, first = time.perf_counter(), None
    while engine.has_unfinished_requests():
        engine.step()
        if first is None and engine.stats().generation_tokens_total > generated0:
            first = time.perf_counter()  # the prefill step(s) done: decoding from here
    end = time.perf_counter()
    generated = engine.stats().generation_tokens_total - generated0
    drafts, accepted = sched.num_draft_tokens - drafts0, sched.num_accepted_tokens - accepted0
    verifications = sched.num_verifications - verif0
    decode_tokens = generated - len(prompts)  # each request's first token comes with its prefill
    return {
        "decode_tok_s": decode_tokens / (end - first) if first and end > first else 0.0,
        "total_s": end - start,
        "acceptance": accepted / drafts if drafts else 0.0,
        "accepted_per_verification": accepted / verifications if verifications else 0.0,
        "draft_tokens": drafts,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_spec", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default="loadtest_out/models/smollm-135m-random")
    p.add_argument("--ks", default="2,4,8")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="the policy's max_batch_size (default: the config's own)",
    )
    p.add_argument("--adversarial", action="store_true", help="drafts that are never accepted")
    p.add_argument(
        "--draft",
        default=None,
        help="a draft model's checkpoint (method draft_model) instead of n-grams",
    )
    p.add_argument("--quantization", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file for every run")
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    if (
        args.adversarial
    ):  # the previous token + 1, k times: a random model's greedy run never continues so
        spec_decode.Proposer.draft = lambda self, request, k: (
            [(request.all_token_ids[-1] + 1) % 20000] * k
        )
    rng = np.random.default_rng(args.seed)
    results = []
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.output_len,
        ignore_eos=True,
        seed=args.seed if args.temperature > 0 else None,
    )
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = [rng.integers(100, 20000, args.input_len).tolist() for _ in range(batch)]
        for rnd in range(args.rounds):
            for k in [0, *ks]:
                spec = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k}
                if spec is not None and args.draft:
                    spec.update(method="draft_model", model=args.draft)
                if spec is not None and args.max_batch_size is not None:
                    spec["max_batch_size"] = args.max_batch_size
                r = run_once(args.model, spec, prompts, params, args.quantization)
                r.update(batch=batch, k=k, round=rnd)
                results.append(r)
                print(
                    f"batch {batch:3d} round {rnd} K={k}: decode {r['decode_tok_s']:7.1f} tok/s, "
                    f"acceptance {r['acceptance']:.2f}, {r['accepted_per_verification']:.2f} accepted per "
                    f"verification, {r['draft_tokens']} drafts",
                    flush=True,
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
