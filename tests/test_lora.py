"""LoRA adapters end to end: kvserve's greedy tokens and logprobs equal PEFT's merged model (fp32).

Two random PEFT adapters of different ranks on a tiny random Llama (one on every target with
plain scaling, one on a few targets with rsLoRA), mixed in one batch with the base model,
through chunked prefill, prefix-cache hits and preemption; then in bf16 on the CPU kernel set,
where the C++ decoder stack runs the adapters and gives the Python forward's bits; then what is
refused.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.lora_request import LoRARequest
from tests.checkpoints import make_checkpoint

# peft is imported where it is used: it imports triton, which tests/test_triton_*.py must import first
# (after setting TRITON_INTERPRET) when one process runs them all
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None, reason="peft is not installed"
)

TIE_GAP = 1e-4
MAX_TOKENS = 8
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, out: Path, r: int, seed: int, targets: list[str], **config) -> str:
    """A PEFT adapter with random A and B (PEFT starts B at zero: the adapter would change nothing)."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.LoraConfig(
        r=r,
        lora_alpha=config.pop("lora_alpha", 2 * r),
        target_modules=targets,
        lora_dropout=0.0,
        **config,
    )
    wrapped = peft.get_peft_model(model, lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    wrapped.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    base = make_checkpoint(root / "base", "llama")
    return {
        "base": base,
        "a": make_adapter(base, root / "a", 8, seed=1, targets=ALL_TARGETS),
        "b": make_adapter(
            base,
            root / "b",
            4,
            seed=2,
            targets=["q_proj", "v_proj", "down_proj"],
            use_rslora=True,
            lora_alpha=3,
        ),
    }


@functools.cache
def reference_model(base: str, adapter: str | None):
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is None:
        return model
    return peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


@functools.cache
def reference_greedy(base: str, adapter: str | None, prompt: tuple[int, ...]):
    """(tokens, per-step logprobs [steps, V], steps free of near-ties) from the merged model."""
    with torch.no_grad():
        out = reference_model(base, adapter).generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    logits = torch.cat(out.logits).float()
    top2 = logits.topk(2, dim=-1).values
    ties = (top2[:, 0] - top2[:, 1] < TIE_GAP).nonzero()
    trusted = int(ties[0, 0]) if len(ties) else MAX_TOKENS
    return out.sequences[0, len(prompt) :].tolist(), torch.log_softmax(logits, -1), trusted


def assert_matches(dirs, prompts, adapters, outs) -> None:
    num_trusted = 0
    for prompt, adapter, out in zip(prompts, adapters, outs):
        tokens, logprobs, trusted = reference_greedy(
            dirs["base"], dirs[adapter] if adapter else None, tuple(prompt)
        )
        got = out.outputs[0]
        num_trusted += trusted
        assert got.token_ids[:trusted] == tokens[:trusted], (adapter, len(prompt))
        for step in range(trusted):
            for token_id, lp in got.logprobs[step].items():
                assert lp.logprob == pytest.approx(logprobs[step, token_id].item(), abs=1e-4), (
                    adapter,
                    step,
                )
    assert (
        num_trusted >= len(prompts) * MAX_TOKENS // 2
    )  # near-ties are rare: the comparison is not vacuous


def requests(dirs) -> dict[str | None, LoRARequest | None]:
    return {None: None, "a": LoRARequest("a", 1, dirs["a"]), "b": LoRARequest("b", 2, dirs["b"])}


def make_llm(dirs, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_loras", 2)
    kw.setdefault("max_lora_rank", 8)
    kw.setdefault("dtype", "float32")
    return LLM(dirs["base"], device="cpu", enable_lora=True, **kw)


def make_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)


MIXED = [None, "a", "b", "a", "b", None]


@pytest.mark.parametrize(
    "kw",
    [{}, {"max_num_batched_tokens": 16}, {"attention_backend": "torch"}],
    ids=["default", "chunked-prefill", "torch-attention"],
)
def test_batch_mixing_adapters_and_base_matches_merged_peft(dirs, kw):
    llm = make_llm(dirs, **kw)
    prompts = make_prompts([1, 3, 7, 17, 30, 9])
    loras = requests(dirs)
    outs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=[loras[a] for a in MIXED])
    assert_matches(dirs, prompts, MIXED, outs)
    # the adapters change the output: the comparison is not vacuous
    assert (
        outs[1].outputs[0].token_ids
        != llm.generate(prompts[1], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    )


def test_more_adapters_than_slots_wait_their_turn(dirs):
    llm = make_llm(dirs, max_loras=1, max_cpu_loras=1)  # every switch refills the one slot
    prompts = make_prompts([5, 6, 7, 8, 9, 10], seed=2)
    loras = requests(dirs)
    outs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=[loras[a] for a in MIXED])
    assert_matches(dirs, prompts, MIXED, outs)
    # once they finished, reading another adapter drops the least recently used from host memory
    for adapter in ("a", "b", "a"):  # each read again from its directory
        out = llm.generate(prompts[0], greedy(), use_tqdm=False, lora_request=loras[adapter])
        assert_matches(dirs, prompts[:1], [adapter], out)
        assert list(llm.engine.runner.lora.cpu) == [loras[adapter].lora_int_id]


def test_an_adapter_in_use_stays_read_when_its_directory_goes(dirs, tmp_path):
    """max_cpu_loras=1 and two adapters queued: reading the second keeps the first (its request
    waits), so deleting the first's directory before its turn costs nothing."""
    llm = make_llm(dirs, max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    doomed = shutil.copytree(dirs["a"], tmp_path / "a")
    loras = [LoRARequest("a", 1, str(doomed)), LoRARequest("b", 2, dirs["b"])]
    prompts = make_prompts([7, 9], seed=5)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_processed(str(i), engine.process_prompt(prompt, greedy(), lora))
    shutil.rmtree(doomed)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert_matches(dirs, prompts, ["a", "b"], [outs["0"], outs["1"]])
    assert sorted(engine.runner.lora.cpu) == [1, 2]  # a was in use when b was read
    # nothing in use now: the next read trims host memory back to max_cpu_loras
    llm.generate(prompts[1], greedy(), use_tqdm=False, lora_request=loras[1])
    assert list(engine.runner.lora.cpu) == [2]
    with pytest.raises(ValueError, match="adapter_config.json"):  # a is gone with its directory
        llm.generate(prompts[0], greedy(), use_tqdm=False, lora_request=loras[0])
    assert not engine.has_unfinished_requests()


def test_prefix_cache_never_shared_between_adapters(dirs):
    llm = make_llm(dirs)
    engine, loras = llm.engine, requests(dirs)
    prompt = make_prompts([20], seed=3)[0]
    order = ["a", "b", None, "a"]
    outs, cached = [], []
    for adapter in order:
        before = engine.prompt_tokens_cached_total
        outs += llm.generate(prompt, greedy(), use_tqdm=False, lora_request=loras[adapter])
        cached.append(engine.prompt_tokens_cached_total - before)
    assert cached[:3] == [0, 0, 0]  # same tokens, other adapter: no KV reused
    assert cached[3] > 0  # the same adapter again: its own blocks
    assert_matches(dirs, [prompt] * 4, order, outs)


def test_preemption_recomputes_under_the_same_adapter(dirs):
    llm = make_llm(dirs, num_kv_blocks=14, max_num_seqs=4)
    prompts = make_prompts([9, 10, 11, 12], seed=4)
    adapters = ["a", "b", "a", None]
    loras = requests(dirs)
    outs = llm.generate(
        prompts, greedy(), use_tqdm=False, lora_request=[loras[a] for a in adapters]
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert_matches(dirs, prompts, adapters, outs)


# ---- bf16 on the CPU kernel set: the adapters inside the C++ decoder stack ----------------------


@pytest.fixture(scope="module")
def dirs32(tmp_path_factory) -> dict[str, str]:
    """As `dirs`, on a base with head_dim 32 (the paged attention kernels' smallest: the stack runs it)."""
    root = tmp_path_factory.mktemp("lora32")
    base = make_checkpoint(
        root / "base",
        "llama",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
    )
    return {
        "base": base,
        "a": make_adapter(base, root / "a", 8, seed=1, targets=ALL_TARGETS),
        "b": make_adapter(
            base,
            root / "b",
            4,
            seed=2,
            targets=["q_proj", "v_proj", "down_proj"],
            use_rslora=True,
            lora_alpha=3,
        ),
    }


def generate_bf16(dirs, quantization: str | None, eager: bool):
    """Mixed adapters and base rows through chunked prefill, preemption and (second round) prefix hits."""
    from kvserve.models.lora_cpu import CpuLoRALinear

    llm = LLM(
        dirs["base"],
        dtype="bfloat16",
        device="cpu",
        block_size=4,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        quantization=quantization,
        enforce_eager=eager,
        max_num_batched_tokens=16,
        num_kv_blocks=12,
        max_num_seqs=4,
    )
    runner = llm.engine.runner
    assert (runner.cpu_stack is None) == eager  # LoRA keeps the stack on; eager: the Python forward
    assert all(isinstance(w, CpuLoRALinear) for w in runner.lora.wrappers.values())
    loras = requests(dirs)
    prompts = make_prompts([1, 3, 7, 17, 30, 9], seed=7)
    outs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=[loras[a] for a in MIXED])
    before = llm.engine.prompt_tokens_cached_total
    outs += llm.generate(
        prompts[3:], greedy(), use_tqdm=False, lora_request=[loras[a] for a in MIXED[3:]]
    )
    assert (
        llm.engine.prompt_tokens_cached_total > before and llm.engine.scheduler.num_preemptions > 0
    )
    return prompts + prompts[3:], MIXED + MIXED[3:], outs


def assert_near_peft(dirs, prompts, adapters, outs) -> None:
    """bf16 first tokens near PEFT's fp32 merged model: the logprob within 0.15, the token where the
    reference's leader is clear (bf16 may swap closer ones)."""
    num_clear = 0
    for prompt, adapter, out in zip(prompts, adapters, outs):
        tokens, logprobs, _ = reference_greedy(
            dirs["base"], dirs[adapter] if adapter else None, tuple(prompt)
        )
        first = out.outputs[0].logprobs[0]
        assert first[tokens[0]].logprob == pytest.approx(logprobs[0, tokens[0]].item(), abs=0.15), (
            adapter
        )
        top2 = logprobs[0].topk(2).values
        if top2[0] - top2[1] > 0.3:
            num_clear += 1
            assert out.outputs[0].token_ids[0] == tokens[0], adapter
    assert num_clear >= 2


@pytest.mark.usefixtures("kernel_set")
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_bf16_stack_runs_the_adapters_with_the_python_forwards_bits(dirs32, quantization):
    """The C++ decoder stack with LoRA equals the Python forward (the same CPU op after each linear)
    token for token and logprob for logprob, and stays near PEFT's fp32 merged model."""
    prompts, adapters, outs = generate_bf16(dirs32, quantization, eager=False)
    _, _, eager_outs = generate_bf16(dirs32, quantization, eager=True)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs] == [
        (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eager_outs
    ]
    if (
        quantization is None
    ):  # (int8 weights alone move these logits further from PEFT's fp32 model)
        assert_near_peft(dirs32, prompts, adapters, outs)
    adapted = (
        outs[1].outputs[0].token_ids
    )  # the adapters change the output: the comparison is not vacuous
    assert adapted != next(o for o, a in zip(outs, adapters) if a is None).outputs[0].token_ids


@pytest.mark.usefixtures("kernel_set")
@pytest.mark.parametrize("max_rank", [5, 8])
def test_cpu_lora_op_matches_the_torch_reference(max_rank):
    """models/lora_cpu.py's packed slots and op against lora_apply_torch in fp32: a packed linear of
    three shards (one of 40 columns: a partial block), ranks below the slot's, an odd max rank, rows
    of two slots and the base interleaved."""
    import numpy as np

    from kvserve.engine.worker.lora import group_tokens
    from kvserve.models import cpu_ops
    from kvserve.models.layers import PackedLinear
    from kvserve.models.lora import LoRABatch, lora_apply_torch
    from kvserve.models.lora_cpu import CpuLoRALinear

    g = torch.Generator().manual_seed(0)
    base = PackedLinear(64, [96, 40, 40], shard_ids=["q", "k", "v"])
    batch = LoRABatch()
    wrapper = CpuLoRALinear(
        base.to(torch.bfloat16),
        3,
        max_rank,
        batch,
        lora_apply_torch,
        torch.bfloat16,
        torch.device("cpu"),
    )
    for slot, rank in ((0, max_rank), (2, 3)):
        shards = {
            i: (torch.randn(rank, 64, generator=g), torch.randn(n, rank, generator=g))
            for i, n in enumerate([96, 40, 40])
            if (i, slot) != (1, 2)
        }  # slot 2 leaves k out
        wrapper.set_slot(slot, {i: (a.bfloat16(), b.bfloat16()) for i, (a, b) in shards.items()})
    row_slots, query_lens = np.array([2, -1, 0, 2]), np.array([3, 2, 1, 4])
    batch.meta = group_tokens(row_slots, query_lens, torch.device("cpu"))
    x = torch.randn(10, 64, generator=g).bfloat16()
    y = torch.randn(10, 176, generator=g).bfloat16()
    got = y.clone()
    rows = (
        batch.meta.token_order,
        batch.meta.seg_starts,
        batch.meta.seg_lens,
        batch.meta.seg_slots,
    )
    cpu_ops.lora_apply_(
        got, x, wrapper.packed_a, wrapper.packed_b, wrapper.shard_n, wrapper.rank_pad, rows
    )
    want = lora_apply_torch(
        y.float(), x.float(), wrapper.lora_a.float(), wrapper.lora_b.float(), batch.meta
    )
    assert torch.equal(got[3:5], y[3:5])  # the base rows are untouched
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.02)


@pytest.mark.usefixtures("kernel_set")
def test_cpu_lora_op_gives_a_row_the_same_bits_alone_or_batched():
    """lora.cpp's tiles, chunks and parallel regions never change a row's sums: 64 decode rows
    over 6 slots (one region), one slot's 70-row prefill (a region for shrinks, one for expands)
    and each row alone give the same bits."""
    import numpy as np

    from kvserve.engine.worker.lora import group_tokens
    from kvserve.models import cpu_ops
    from kvserve.models.layers import PackedLinear
    from kvserve.models.lora import LoRABatch, lora_apply_torch
    from kvserve.models.lora_cpu import CpuLoRALinear

    g = torch.Generator().manual_seed(0)
    sizes, k = [96, 40, 200], 576
    batch = LoRABatch()
    base = PackedLinear(k, sizes, shard_ids=["q", "k", "v"]).to(torch.bfloat16)
    cpu = torch.device("cpu")
    wrapper = CpuLoRALinear(base, 6, 16, batch, lora_apply_torch, torch.bfloat16, cpu)
    for slot, rank in enumerate([16, 3, 8, 16, 5, 16]):
        shards = {
            i: (torch.randn(rank, k, generator=g), torch.randn(n, rank, generator=g))
            for i, n in enumerate(sizes)
        }
        wrapper.set_slot(
            slot, {i: (0.1 * a.bfloat16(), 0.1 * b.bfloat16()) for i, (a, b) in shards.items()}
        )

    def apply(x: torch.Tensor, y: torch.Tensor, row_slots, query_lens) -> torch.Tensor:
        meta = group_tokens(np.array(row_slots), np.array(query_lens), cpu)
        got = y.clone()
        rows = (meta.token_order, meta.seg_starts, meta.seg_lens, meta.seg_slots)
        cpu_ops.lora_apply_(
            got, x, wrapper.packed_a, wrapper.packed_b, wrapper.shard_n, wrapper.rank_pad, rows
        )
        return got

    for row_slots, query_lens in (([i % 6 for i in range(64)], [1] * 64), ([3], [70])):
        t = sum(query_lens)
        x, y = (
            torch.randn(t, k, generator=g).bfloat16(),
            torch.randn(t, sum(sizes), generator=g).bfloat16(),
        )
        got = apply(x, y, row_slots, query_lens)
        assert not torch.equal(got, y)
        slot_of = np.repeat(row_slots, query_lens)
        for t_i in (0, 5, t - 1):
            alone = apply(x[t_i : t_i + 1], y[t_i : t_i + 1], [int(slot_of[t_i])], [1])
            assert torch.equal(alone[0], got[t_i])


# ---- refused -----------------------------------------------------------------------------------


def _edit_config(src: str, dst: Path, **changes) -> str:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.fixture(scope="module")
def llm(dirs) -> LLM:
    return make_llm(dirs, max_lora_rank=4)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
        ({"r": 8}, "r=8"),
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
    ],
)
def test_refused_adapter_config_names_the_field(dirs, llm, tmp_path, change, field):
    path = _edit_config(dirs["b"], tmp_path / "bad", **change)
    with pytest.raises(ValueError, match=field):
        llm.generate([1, 2, 3], greedy(), use_tqdm=False, lora_request=LoRARequest("bad", 9, path))
    assert not llm.engine.has_unfinished_requests()
    assert 9 not in llm.engine.runner.lora.cpu  # nothing half-loaded


def test_refused_adapters_leave_the_engine_serving(dirs, llm, tmp_path):
    with pytest.raises(ValueError, match="max_lora_rank"):  # adapter a has r=8
        llm.generate(
            [1, 2, 3], greedy(), use_tqdm=False, lora_request=LoRARequest("a", 1, dirs["a"])
        )
    other = make_checkpoint(tmp_path / "other", "llama", hidden_size=32, intermediate_size=64)
    wrong = make_adapter(other, tmp_path / "wrong", 4, seed=3, targets=["q_proj"])
    with pytest.raises(ValueError, match="base model expects"):
        llm.generate(
            [1, 2, 3], greedy(), use_tqdm=False, lora_request=LoRARequest("wrong", 3, wrong)
        )
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate(
            [1, 2, 3], greedy(), use_tqdm=False, lora_request=LoRARequest("none", 4, str(tmp_path))
        )
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, dirs["b"])
    out = llm.generate(
        [1, 2, 3], greedy(), use_tqdm=False, lora_request=LoRARequest("b", 2, dirs["b"])
    )
    assert_matches(dirs, [[1, 2, 3]], ["b"], out)


def test_remove_frees_the_id_for_another_adapter(dirs, llm):
    engine, prompt = llm.engine, [4, 5, 6]
    llm.generate(prompt, greedy(), use_tqdm=False, lora_request=LoRARequest("b", 7, dirs["b"]))
    with pytest.raises(ValueError, match="lora_int_id 7 is already"):
        engine.add_lora(LoRARequest("b2", 7, dirs["a"]))
    assert engine.remove_lora(7) and not engine.remove_lora(7)
    other = _edit_config(dirs["b"], Path(dirs["b"]).parent / "b-alpha", lora_alpha=9)
    out = llm.generate(prompt, greedy(), use_tqdm=False, lora_request=LoRARequest("b2", 7, other))
    base = llm.generate(
        prompt, greedy(), use_tqdm=False, lora_request=LoRARequest("b", 2, dirs["b"])
    )
    assert (
        out[0].outputs[0].logprobs != base[0].outputs[0].logprobs
    )  # the new adapter's scaling, not the old


def test_lora_request_needs_enable_lora(dirs):
    plain = LLM(dirs["base"], dtype="float32", device="cpu", block_size=4)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate(
            [1, 2], greedy(), use_tqdm=False, lora_request=LoRARequest("b", 2, dirs["b"])
        )
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(dirs["base"], device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=1)
