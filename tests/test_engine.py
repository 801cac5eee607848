"""End to end: the engine's greedy tokens and log-probabilities equal transformers'.

Every family runs a batch of prompts of mixed lengths (1 token to several blocks,
longer than Mistral's sliding window of 24) in fp32. Exact logit ties are guarded:
a sequence is compared only up to the first step where transformers' top two
logits are closer than TIE_GAP, since either token is then a correct greedy choice.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from kvserve.engine import LLM, SamplingParams

TIE_GAP = 1e-4
PROMPT_LENGTHS = [1, 3, 7, 17, 40]
MAX_TOKENS = 12


def make_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@functools.cache
def hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def hf_greedy(path: str, prompt: tuple[int, ...], max_tokens: int):
    """transformers' greedy tokens, per-step log-probs, and how many steps are tie-free."""
    model = hf_model(path)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=max_tokens,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = torch.cat(out.logits).float()  # [steps, vocab]
    top2 = logits.topk(2, dim=-1).values
    ties = (top2[:, 0] - top2[:, 1] < TIE_GAP).nonzero()
    num_trusted = (
        int(ties[0, 0]) + 1 if len(ties) else len(tokens)
    )  # the tied step itself is unsure
    return tokens, torch.log_softmax(logits, -1), num_trusted - (1 if len(ties) else 0)


def assert_greedy_matches(path: str, prompts, outs, check_logprobs: bool = False):
    for prompt, out in zip(prompts, outs):
        tokens, logprobs, trusted = hf_greedy(path, tuple(prompt), MAX_TOKENS)
        got = out.outputs[0].token_ids
        assert got[:trusted] == tokens[:trusted], f"prompt len {len(prompt)}"
        if check_logprobs:
            for step in range(trusted):
                entry = out.outputs[0].logprobs[step]
                for token_id, lp in entry.items():
                    assert lp.logprob == pytest.approx(logprobs[step, token_id].item(), abs=1e-4)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def make_llm(path: str, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    return LLM(path, dtype="float32", device="cpu", **kw)


def assert_no_leaks(llm: LLM):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks - 1


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gpt2"])
def test_greedy_and_logprobs_match_transformers(checkpoint_dirs, family):
    path = checkpoint_dirs[family]
    llm = make_llm(path)
    prompts = make_prompts(llm.engine.info.vocab_size)
    outs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    assert_greedy_matches(path, prompts, outs, check_logprobs=True)
    for out in outs:
        comp = out.outputs[0]
        assert comp.finish_reason == "length" and len(comp.token_ids) == MAX_TOKENS
        assert comp.cumulative_logprob == pytest.approx(
            sum(comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)), abs=1e-4
        )
        assert all(len(entry) >= 3 for entry in comp.logprobs)
    assert_no_leaks(llm)


@pytest.fixture
def without_cpu_kernels(monkeypatch):
    """Run on the portable PyTorch path: what CUDA uses, and CPUs where models/csrc cannot be built."""
    from kvserve.models import cpu_ops

    monkeypatch.setattr(cpu_ops, "load", lambda: False)
    monkeypatch.setattr(cpu_ops, "has_fast_bf16", lambda: False)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_portable_path_matches_transformers(checkpoint_dirs, family, without_cpu_kernels):
    path = checkpoint_dirs[family]
    llm = make_llm(path, max_num_batched_tokens=16)  # chunked prefill after a cached prefix too
    prompts = make_prompts(llm.engine.info.vocab_size)
    outs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    assert_greedy_matches(path, prompts, outs, check_logprobs=True)
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "max_num_seqs", [256, 2]
)  # 2: prompt rows scored in chunks of 2 (bounded memory)
def test_prompt_logprobs_match_transformers(llama_dir, max_num_seqs):
    llm = make_llm(
        llama_dir, max_num_batched_tokens=8, max_num_seqs=max_num_seqs
    )  # chunked prefill too
    prompts = make_prompts(llm.engine.info.vocab_size)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    model = hf_model(llama_dir)
    for prompt, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            assert prompt[pos] in entry and len(entry) >= 2
            for token_id, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[pos - 1, token_id].item(), abs=1e-4)
            ranks = (ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum().item() + 1
            assert entry[prompt[pos]].rank == ranks


@pytest.mark.parametrize(
    "setting",
    [
        dict(max_num_batched_tokens=5),  # chunked prefill mixed with decodes
        dict(num_kv_blocks=16),  # so small that requests are preempted and recomputed
        dict(max_num_seqs=2),  # requests queue and join as others finish
        dict(enable_prefix_caching=False),
    ],
)
def test_same_greedy_under_scheduling_pressure(checkpoint_dirs, setting):
    path = checkpoint_dirs["mistral"]  # sliding window makes recompute paths stricter
    llm = make_llm(path, **setting)
    prompts = make_prompts(llm.engine.info.vocab_size)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert_greedy_matches(path, prompts, outs)
    if "num_kv_blocks" in setting:
        assert llm.engine.stats().num_preemptions_total > 0
    assert_no_leaks(llm)


def test_prefix_cache_hits_give_same_output(llama_dir):
    llm = make_llm(llama_dir)
    prompts = make_prompts(llm.engine.info.vocab_size)
    first = llm.generate(prompts, greedy(), use_tqdm=False)
    shared = [prompts[-1][:30] + p for p in prompts]  # a common 30-token prefix
    second = llm.generate(prompts + shared, greedy(), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits_total > 0
    assert [o.outputs[0].token_ids for o in first] == [
        o.outputs[0].token_ids for o in second[: len(prompts)]
    ]
    assert_greedy_matches(llama_dir, shared, second[len(prompts) :])
    assert_no_leaks(llm)


def test_a_continuation_copies_the_partly_filled_last_block(llama_dir):
    """A request whose tokens run on past a finished one's (its prompt and output, ending mid-block)
    copies that request's last partial block (copy-on-write) and computes only the rest: the same
    tokens as computing everything."""
    llm = make_llm(llama_dir)
    prompt = [(7 * i + 3) % llm.engine.info.vocab_size for i in range(21)]  # 21 = 5 blocks of 4 + 1
    six = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (first,) = llm.generate([{"prompt_token_ids": prompt}], six, use_tqdm=False)
    follow = (
        prompt + first.outputs[0].token_ids + [3, 5]
    )  # its first 26 tokens have K/V: 6 blocks + 2
    before = llm.engine.prompt_tokens_computed_total
    (second,) = llm.generate([{"prompt_token_ids": follow}], greedy(), use_tqdm=False)
    assert llm.engine.prompt_tokens_computed_total - before == len(follow) - 26
    assert_greedy_matches(llama_dir, [follow], [second])
    assert_no_leaks(llm)


def test_n_samples_share_prompt_and_match_greedy(llama_dir):
    llm = make_llm(llama_dir)
    prompts = make_prompts(llm.engine.info.vocab_size)
    outs = llm.generate(prompts, greedy(n=3), use_tqdm=False)
    for out in outs:
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert_greedy_matches(llama_dir, prompts, outs)
    sampled = llm.generate(
        prompts[3], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=3), use_tqdm=False
    )[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    assert_no_leaks(llm)


def test_requests_added_while_others_run(llama_dir):
    llm = make_llm(llama_dir)
    engine = llm.engine
    prompts = make_prompts(engine.info.vocab_size)
    done = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy())
        for _ in range(3):  # the others are mid-generation when the next arrives
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert_greedy_matches(llama_dir, prompts, [done[str(i)] for i in range(len(prompts))])
    assert_no_leaks(llm)


def test_abort_frees_blocks_at_any_point(llama_dir):
    llm = make_llm(llama_dir, max_num_batched_tokens=8)
    engine = llm.engine
    prompts = make_prompts(engine.info.vocab_size)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(n=2))
    engine.step()
    final = engine.abort("4")  # mid-prefill
    assert final.finished and {c.finish_reason for c in final.outputs} == {"abort"}
    engine.step()
    for i in range(4):
        engine.abort(str(i))
    assert engine.abort("unknown") is None
    assert_no_leaks(llm)


def test_seeded_sampling_is_independent_of_the_batch(llama_dir):
    llm = make_llm(llama_dir)
    prompts = make_prompts(llm.engine.info.vocab_size)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=10, seed=s) for s in range(3)] + [
        SamplingParams(temperature=1.0, max_tokens=10)
    ] * 2
    batch = llm.generate(
        prompts[:2] + [prompts[2]] + prompts[3:] + [prompts[0]],
        others[:2] + [params] + others[2:],
        use_tqdm=False,
    )
    assert batch[2].outputs[0].token_ids == alone
    other_seed = llm.generate(
        [prompts[2]],
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=99, ignore_eos=True),
        use_tqdm=False,
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_stop_strings_and_stop_token_ids(llama_dir):
    llm = make_llm(llama_dir)
    prompt = make_prompts(llm.engine.info.vocab_size)[3]
    full = llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate([prompt], greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    stop_id = full.token_ids[4]
    out = llm.generate([prompt], greedy(stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert_no_leaks(llm)


def test_eos_from_generation_config_stops(llama_dir):
    llm = make_llm(llama_dir)
    assert set(llm.engine.info.eos_token_ids) >= {0}
    prompts = make_prompts(llm.engine.info.vocab_size)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    for out in outs:
        comp = out.outputs[0]
        if comp.finish_reason == "stop":
            assert comp.token_ids[-1] in llm.engine.info.eos_token_ids
        else:
            assert len(comp.token_ids) == 64


def test_string_prompts_and_text(llama_dir):
    llm = make_llm(llama_dir)
    outs = llm.generate(["Hello café 東京", "The quick brown fox"], greedy(), use_tqdm=False)
    tok = llm.tokenizer
    for out in outs:
        assert out.prompt_token_ids == tok.encode(out.prompt)
        comp = out.outputs[0]
        assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], SamplingParams(), "empty"),
        ("", SamplingParams(), "empty"),
        ([10**6], SamplingParams(), "token ids"),
        ([1] * 500, SamplingParams(max_tokens=100), "context length"),
        ([1, 2], SamplingParams(max_tokens=10_000), "context length"),
    ],
)
def test_bad_requests_raise_value_error(llama_dir, prompt, params, match):
    llm = make_llm(llama_dir)
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params, use_tqdm=False)
    assert_no_leaks(llm)


def test_request_that_can_never_fit_the_kv_cache(llama_dir):
    llm = make_llm(llama_dir, num_kv_blocks=5)  # 16 tokens
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([[1] * 10], SamplingParams(max_tokens=10), use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=-1), "max_num_seqs"),
        (dict(dtype="int8"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(max_model_len=10**6), "max_model_len"),
        (dict(attention_backend="flash"), "attention_backend"),
        (dict(gpu_memory_utilization=0), "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(enforce_eager="yes"), "enforce_eager"),
        (dict(device="cpu", attention_backend="triton"), "triton"),
    ],
)
def test_bad_engine_args(llama_dir, kwargs, match, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the Triton tests set it)
    with pytest.raises(ValueError, match=match):
        LLM(llama_dir, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gpt2"])
def test_cuda_greedy_matches_transformers(checkpoint_dirs, family):
    """On a CUDA machine (`pytest -m gpu`): the same checks as on CPU, in fp32 on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = checkpoint_dirs[family]
    llm = LLM(path, dtype="float32", device="cuda", block_size=4, max_num_batched_tokens=16)
    prompts = make_prompts(llm.engine.info.vocab_size)
    outs = llm.generate(prompts, greedy(logprobs=3, n=2), use_tqdm=False)
    assert_greedy_matches(path, prompts, outs, check_logprobs=True)
    assert_no_leaks(llm)
