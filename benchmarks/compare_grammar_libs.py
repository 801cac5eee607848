"""xgrammar vs llguidance on real generation: the per-step bitmask fill for the same token sequences.

    pip install llguidance==1.9.1   # not a kvserve dependency; only this comparison uses it
    python -m benchmarks.compare_grammar_libs [--cases json_schema_bounded,json_schema,json_schema_mixed]

For each case of benchmarks/bench_structured.py, the engine generates 64 greedy constrained
sequences (64 tokens, SmolLM-135M-shaped checkpoint, bf16, CPU); their tokens are then replayed
into one matcher per sequence of each library, and each step's batched fill (2 threads) is timed.
Also counts the rows whose masks differ and the rows llguidance refused a token xgrammar allowed
(those rows are dropped from both). Results are printed; docs/structured_outputs.md has them.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from benchmarks.bench_structured import CASES
from benchmarks.smollm_checkpoint import build_smollm_like


def _matchers(tokenizer, vocab_size: int, eos: list[int], schema: dict, count: int):
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
    grammar = xgr.GrammarCompiler(info, max_threads=2).compile_json_schema(
        json.dumps(schema), any_whitespace=False, strict_mode=True
    )
    xgr_matchers = [xgr.GrammarMatcher(grammar) for _ in range(count)]
    batch = xgr.BatchGrammarMatcher(2)

    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    llg_grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema),
        defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    )  # xgrammar's compact form
    llg_matchers = [llguidance.LLMatcher(llg_tokenizer, llg_grammar) for _ in range(count)]
    executor = llguidance.LLExecutor(2)

    def fill_xgr(rows, out):
        batch.batch_fill_next_token_bitmask([xgr_matchers[i] for i in rows], out, indices=rows)

    def fill_llg(rows, out):
        llguidance.numpy.fill_next_token_bitmask_par(
            executor, [(llg_matchers[i], i) for i in rows], out
        )

    return xgr_matchers, llg_matchers, fill_xgr, fill_llg


def compare(llm, case: str, num_seqs: int, num_tokens: int, rng) -> str:
    from kvserve.engine import SamplingParams
    from kvserve.engine.sampling_params import StructuredOutputs

    info, schema = llm.engine.info, CASES[case]
    prompts = [rng.integers(3, info.vocab_size, 128).tolist() for _ in range(num_seqs)]
    params = SamplingParams(
        temperature=0,
        max_tokens=num_tokens,
        ignore_eos=True,
        structured_outputs=StructuredOutputs(json=schema),
    )
    seqs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    xgr_m, llg_m, fill_xgr, fill_llg = _matchers(
        llm.engine.tokenizer, info.vocab_size, list(info.eos_token_ids), schema, num_seqs
    )
    words = -(-info.vocab_size // 32)
    mask_x, mask_l = np.zeros((num_seqs, words), np.int32), np.zeros((num_seqs, words), np.int32)
    live, refused, differ, t_x, t_l = list(range(num_seqs)), 0, 0, [], []
    for step in range(min(map(len, seqs))):
        start = time.perf_counter()
        fill_xgr(live, mask_x)
        t_x.append(time.perf_counter() - start)
        start = time.perf_counter()
        fill_llg(live, mask_l)
        t_l.append(time.perf_counter() - start)
        differ += int((mask_x[live] != mask_l[live]).any(axis=1).sum())
        for i in list(live):
            xgr_m[i].accept_token(seqs[i][step])
            if not llg_m[i].consume_token(seqs[i][step]):
                live.remove(i)
                refused += 1
    return (
        f"{case:20s} fill per step (median): xgrammar {1000 * np.median(t_x):.2f} ms, llguidance "
        f"{1000 * np.median(t_l):.2f} ms; row-steps whose masks differ {differ}; rows llguidance refused {refused}"
    )


def main(argv: list[str] | None = None) -> int:
    from kvserve.engine import LLM

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compare_grammar_libs", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model-dir", default="loadtest_out/models/smollm-135m-random")
    p.add_argument("--cases", default="json_schema_bounded,json_schema,json_schema_mixed")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--num-tokens", type=int, default=64)
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    if bad := [c for c in cases if c not in CASES]:
        p.error(f"unknown case(s) {bad}: choose from {sorted(CASES)}")
    torch.set_num_threads(2)
    llm = LLM(
        str(build_smollm_like(args.model_dir)),
        dtype="bfloat16",
        device="cpu",
        enable_prefix_caching=False,
    )
    rng = np.random.default_rng(0)
    for case in cases:
        print(compare(llm, case, args.num_seqs, args.num_tokens, rng))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
