"""The warm-up step the engine core runs before it reports ready (`ModelRunner.warm_up`): it
leaves the engine as it found it: free blocks, prefix cache, the runner's batch, the RNG and
every later output."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine import SamplingParams
from test_engine import assert_greedy_matches, assert_no_leaks, greedy, make_llm, make_prompts


def engine_state(llm) -> dict:
    engine = llm.engine
    bm, batch = engine.kv_cache_manager, engine.runner.batch
    return {
        "free_block_ids": bm.pool._free.block_ids(),
        "cached_hashes": dict(bm.pool._cached),
        "prefix_cache": (bm.prefix_cache_queries, bm.prefix_cache_hits),
        "batch_rows": (
            list(batch.req_ids),
            dict(batch.row_of),
        ),  # rows past them are stale by design
        "stats": engine.stats(),
    }


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_warm_up_leaves_state_and_outputs_as_before(checkpoint_dirs, family):
    path = checkpoint_dirs[family]
    llm = make_llm(path)
    before = engine_state(llm)
    rng_before = torch.get_rng_state()
    llm.engine.runner.warm_up()
    assert engine_state(llm) == before
    assert torch.equal(torch.get_rng_state(), rng_before)

    prompts = make_prompts(llm.engine.info.vocab_size)
    outs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    assert_greedy_matches(path, prompts, outs, check_logprobs=True)
    assert_no_leaks(llm)
    # the warm-up's tokens (0, 1, ...) were never registered as a cached prefix
    block_size = llm.engine.info.block_size
    llm.generate([list(range(3 * block_size))], greedy(), use_tqdm=False)
    assert llm.engine.kv_cache_manager.prefix_cache_hits == 0


def test_warm_up_keeps_unseeded_sampling_as_without_it(llama_dir):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)  # global RNG, no seed
    prompts = [[5, 6, 7], [9] * 11]
    warmed = make_llm(llama_dir, seed=3)  # the runner seeds torch's global generator
    warmed.engine.runner.warm_up()
    got = [o.outputs[0].token_ids for o in warmed.generate(prompts, params, use_tqdm=False)]
    plain = make_llm(llama_dir, seed=3)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 1},
        {"num_kv_blocks": 2, "max_model_len": 8},
        {"max_model_len": 2, "num_kv_blocks": 3},
    ],
)
def test_warm_up_fits_small_engines(llama_dir, kwargs):
    llm = make_llm(llama_dir, **kwargs)
    before = engine_state(llm)
    llm.engine.runner.warm_up()
    assert engine_state(llm) == before
    out = llm.generate([[4]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1
