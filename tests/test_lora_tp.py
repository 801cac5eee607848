"""LoRA under tensor parallelism (gloo on the CPU): two ranks give one rank's tokens and logprobs
and PEFT's merged model's, with two adapters of different ranks and the base model in one batch;
adapters loaded and removed at run time reach every rank, and one refused by any rank is kept by
none. Each rank's adapter slots, side by side, are the single rank's (replicated KV heads included).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from kvserve.engine.lora_request import LoRARequest
from kvserve.models.loader import load_model
from kvserve.models.lora import LoRABatch, load_adapter, lora_apply_torch, wrap_model
from kvserve.models.parallel import ParallelState
from tests.checkpoints import make_checkpoint
from tests.test_lora import (
    ALL_TARGETS,
    MIXED,
    assert_matches,
    assert_near_peft,
    dirs,  # noqa: F401 - the fixture
    dirs32,  # noqa: F401 - the fixture
    greedy,
    make_adapter,
    make_llm,
    make_prompts,
    requests,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None, reason="peft is not installed"
)


@pytest.fixture(scope="module")
def tp_llm(dirs):  # noqa: F811
    llm = make_llm(dirs, tensor_parallel_size=2, max_num_batched_tokens=16)
    yield llm
    llm.shutdown()


def test_two_ranks_match_one_rank_and_merged_peft(dirs, tp_llm):  # noqa: F811
    """Mixed adapters (ranks 8 and 4, rsLoRA) and base rows through chunked prefill."""
    prompts = make_prompts([1, 3, 7, 17, 30, 9])
    loras = requests(dirs)
    lora_requests = [loras[a] for a in MIXED]
    outs = tp_llm.generate(prompts, greedy(), use_tqdm=False, lora_request=lora_requests)
    assert_matches(dirs, prompts, MIXED, outs)
    one = make_llm(dirs, max_num_batched_tokens=16)
    ref = one.generate(prompts, greedy(), use_tqdm=False, lora_request=lora_requests)
    for got, want in zip(outs, ref):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        for step_got, step_want in zip(got.logprobs, want.logprobs):
            assert step_got.keys() == step_want.keys()
            for token_id, lp in step_got.items():
                assert lp.logprob == pytest.approx(step_want[token_id].logprob, abs=1e-4)


def test_runtime_load_and_remove_reach_every_rank(dirs, tp_llm):  # noqa: F811
    engine, executor, prompt = tp_llm.engine, tp_llm.engine.runner, [4, 5, 6]
    engine.add_lora(LoRARequest("b", 7, dirs["b"]))
    assert executor.driver.has_lora(7)
    out = tp_llm.generate(
        prompt, greedy(), use_tqdm=False, lora_request=LoRARequest("b", 7, dirs["b"])
    )
    assert_matches(dirs, [prompt], ["b"], out)
    assert engine.remove_lora(7) and not engine.remove_lora(7)
    # the id now names another adapter on every rank (the workers' old one is gone, or they refuse)
    out = tp_llm.generate(
        prompt, greedy(), use_tqdm=False, lora_request=LoRARequest("a", 7, dirs["a"])
    )
    assert_matches(dirs, [prompt], ["a"], out)


def test_an_adapter_refused_by_one_rank_is_kept_by_none(dirs, tp_llm, tmp_path):  # noqa: F811
    engine, executor = tp_llm.engine, tp_llm.engine.runner
    engine.add_lora(LoRARequest("b", 8, dirs["b"]))
    executor.driver.remove_lora(8)  # rank 0 alone forgets it: rank 1 still knows 8 as "b"
    with pytest.raises(ValueError, match="rank 1: ValueError: lora_int_id 8 is already 'b'"):
        engine.add_lora(LoRARequest("a", 8, dirs["a"]))
    assert not executor.driver.has_lora(8)  # rank 0 let it go again
    big = make_adapter(dirs["base"], tmp_path / "big", 16, seed=3, targets=["q_proj"])
    with pytest.raises(ValueError, match="max_lora_rank"):  # refused on rank 0: no worker asked
        engine.add_lora(LoRARequest("big", 9, big))
    assert not executor.driver.has_lora(9)
    # the engine still serves, and 8 is free again on every rank
    out = tp_llm.generate(
        [7, 8], greedy(), use_tqdm=False, lora_request=LoRARequest("a", 8, dirs["a"])
    )
    assert_matches(dirs, [[7, 8]], ["a"], out)


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["split-kv", "replicated-kv"])
def test_each_ranks_slots_are_its_part_of_one_ranks(num_kv_heads, tmp_path):
    """Column-parallel slots: whole A, the rank's rows of B; row-parallel: the rank's input columns
    of A, whole B. The partial adds of a row-parallel linear sum to one rank's."""
    base = make_checkpoint(tmp_path / "base", "llama", num_key_value_heads=num_kv_heads)
    adapter = make_adapter(base, tmp_path / "a", 4, seed=5, targets=ALL_TARGETS)

    def slots(rank: int, size: int):
        hf = transformers.AutoConfig.from_pretrained(base)
        model = load_model(base, hf, torch.float32, "cpu", parallel=ParallelState(rank, size))
        wrappers = wrap_model(model, hf.architectures[0], 1, 4, LoRABatch(), lora_apply_torch)
        loaded = load_adapter(adapter, "a", model, wrappers, 4)
        for name, wrapper in wrappers.items():
            wrapper.set_slot(0, loaded.weights.get(name))
        return {name: (w.lora_a[0], w.lora_b[0], w.base) for name, w in wrappers.items()}

    whole, parts = slots(0, 1), [slots(r, 2) for r in range(2)]
    for name, (a, b, _) in whole.items():
        (a0, b0, base0), (a1, b1, _) = parts[0][name], parts[1][name]
        if name.endswith(("o_proj", "down_proj")):
            assert (
                torch.equal(torch.cat([a0, a1], 1), a) and torch.equal(b0, b) and torch.equal(b1, b)
            )
            xs = torch.randn(3, a.shape[1])
            n = a0.shape[1]
            summed = (xs[:, :n] @ a0.T) @ b0.T + (xs[:, n:] @ a1.T) @ b1.T
            torch.testing.assert_close(summed, (xs @ a.T) @ b.T, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(a0, a) and torch.equal(a1, a)
            rows0, rows1 = _rows_per_shard(base0, b0), _rows_per_shard(base0, b1)
            whole_rows = _rows_per_shard(whole[name][2], b)
            for s, (r0, r1, rw) in enumerate(zip(rows0, rows1, whole_rows)):
                if (
                    num_kv_heads == 1 and name.endswith("qkv_proj") and s > 0
                ):  # k, v: one KV head each
                    assert torch.equal(r0, rw) and torch.equal(r1, rw)
                else:
                    assert torch.equal(torch.cat([r0, r1]), rw), (name, s)


@pytest.mark.usefixtures("kernel_set")
def test_two_ranks_in_bf16_run_the_cpu_kernels_near_peft(dirs32):  # noqa: F811
    """bf16 on the CPU kernel set: each rank's wrappers run the packed CPU op (a row-parallel one on
    its partial output, before the all-reduce); the C++ decoder stack stays off under TP."""
    from kvserve.models.lora_cpu import CpuLoRALinear

    llm = make_llm(dirs32, dtype="bfloat16", tensor_parallel_size=2)
    try:
        driver = llm.engine.runner.driver
        assert driver.cpu_stack is None
        assert all(isinstance(w, CpuLoRALinear) for w in driver.lora.wrappers.values())
        prompts = make_prompts([1, 3, 7, 17, 30, 9], seed=7)
        loras = requests(dirs32)
        outs = llm.generate(
            prompts, greedy(), use_tqdm=False, lora_request=[loras[a] for a in MIXED]
        )
    finally:
        llm.shutdown()
    assert_near_peft(dirs32, prompts, MIXED, outs)


def _rows_per_shard(base, b: torch.Tensor) -> list[torch.Tensor]:
    sizes = list(getattr(base, "output_sizes", [b.shape[0]]))
    return list(b.split(sizes))
