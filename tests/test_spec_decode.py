"""Speculative decoding (engine/spec_decode/proposer.py, engine/spec_decode/verify.py): the n-gram proposer, the
config, and exactness: with speculation the engine's outputs are those without it (greedy and
seeded sampling token for token; unseeded sampling in distribution), whatever the drafts, under
chunked prefill, preemption, prefix hits, n > 1, stop strings and max_tokens, and no KV block leaks.

Besides the real n-gram proposer, tests use `forced` drafts (the true continuation, corrupted at
chosen places) so that acceptance, partial acceptance and rejection all happen on tiny models."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvserve.engine import LLM, EngineArgs, SamplingParams
from kvserve.engine.spec_decode import proposer as spec_decode
from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.proposer import ngram_proposal
from server_fixtures import server, server_checkpoint  # noqa: F401  (pytest fixtures)

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "max_batch_size": 64,
}


def make_llm(path: str, spec: dict | None, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    return LLM(path, dtype="float32", device="cpu", speculative_config=spec, **kw)


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks - 1


def prompts_for(vocab_size: int, lengths=(1, 3, 7, 17, 40), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for (
        n
    ) in lengths:  # half random, then the same tokens again: something for prompt lookup to find
        head = torch.randint(3, vocab_size, (max(1, n // 2),), generator=g).tolist()
        out.append((head * 2)[:n])
    return out


def outputs(outs) -> list[tuple]:
    return [
        (tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason)
        for o in outs
        for c in o.outputs
    ]


# ---- the proposer ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens,k,n_min,n_max,want",
    [
        ([1, 2, 3, 4], 3, 1, 3, []),  # nothing repeats
        ([1, 2, 3, 1, 2], 3, 1, 3, [3, 1, 2]),  # "1 2" seen before: what followed it
        ([1, 2, 3, 1, 2], 1, 1, 3, [3]),  # k caps the draft
        (
            [5, 5, 5, 5],
            2,
            1,
            3,
            [5],
        ),  # overlapping: the only earlier "5 5 5" (at 0) leaves one token
        ([5] * 9, 4, 2, 2, [5, 5, 5, 5]),  # a run: the latest occurrence with k tokens after it
        (
            [1, 2, 9, 2, 7, 1, 2],
            2,
            1,
            3,
            [9, 2],
        ),  # longest n first: "1 2" (n=2) beats the later "2" (n=1)
        ([7, 2, 8, 2], 2, 1, 3, [8, 2]),  # n=1 fallback
        ([7, 2, 8, 2], 2, 2, 3, []),  # ... unless n_min forbids it
        ([3], 2, 1, 3, []),  # too short
        (
            [4, 1, 4, 2, 4],
            3,
            1,
            1,
            [1, 4, 2],
        ),  # the latest occurrence with 3 tokens after it (at 0)
        ([4, 1, 4, 2, 4], 1, 1, 1, [2]),  # ... with 1 token after it: the latest (at 2)
    ],
)
def test_ngram_proposal(tokens, k, n_min, n_max, want):
    assert ngram_proposal(tokens, k, n_min, n_max) == want


@pytest.mark.parametrize(
    "value,match",
    [
        ({"method": "eagle"}, "method 'eagle' is not supported"),
        ({"method": "draft_model"}, "'model' \\(the draft checkpoint\\) is required"),
        ({"method": "ngram", "model": "x"}, "only there"),
        ({"method": "ngram", "draft": "x"}, "unknown keys \\['draft'\\]"),
        ({"num_speculative_tokens": 4}, "needs a 'method'"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens must be a positive integer",
        ),
        ({"method": "ngram", "num_speculative_tokens": 17}, "at most 16"),
        (
            {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "below prompt_lookup_min",
        ),
        (
            {"method": "ngram", "prompt_lookup_min": True},
            "prompt_lookup_min must be a positive integer",
        ),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_configs_are_value_errors(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(value)


def test_config_forms(llama_dir):
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse(" ") is None
    assert (
        SpeculativeConfig.parse(
            '{"method": "ngram", "num_speculative_tokens": 2}'
        ).num_speculative_tokens
        == 2
    )
    args = EngineArgs(model=llama_dir, speculative_config={"method": "ngram"})
    assert args.speculative() == SpeculativeConfig()
    with pytest.raises(ValueError, match="speculative must be a bool"):
        SamplingParams(speculative="no")


# ---- exactness with the real proposer ----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gpt2"])
def test_greedy_is_unchanged(checkpoint_dirs, family):
    path = checkpoint_dirs[family]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results, stats = [], []
    for spec in (None, NGRAM):
        llm = make_llm(path, spec)
        results.append(
            outputs(llm.generate(prompts_for(llm.engine.info.vocab_size), params, use_tqdm=False))
        )
        stats.append(
            (llm.engine.scheduler.num_draft_tokens, llm.engine.scheduler.num_accepted_tokens)
        )
        assert_no_leaks(llm)
    assert results[0] == results[1]
    assert (
        stats[0] == (0, 0) and stats[1][0] > 0 and stats[1][1] > 0
    )  # drafts proposed, some accepted


# ---- exactness with forced drafts ------------------------------------------------------------------------


@pytest.fixture
def forced(monkeypatch):
    """Make the proposer draft `truth[request's next tokens]`, corrupted at every `corrupt`-th draft
    (the policy around it, batch size, eligibility and back-off, stays the real one)."""
    state = {"truth": {}, "corrupt": 0, "count": 0}

    def draft(self, request, k):
        done = request.num_output_tokens
        drafts = list(state["truth"].get(tuple(request.prompt_token_ids), [])[done : done + k])
        for i in range(len(drafts)):
            state["count"] += 1
            if state["corrupt"] and state["count"] % state["corrupt"] == 0:
                drafts[i] = (drafts[i] + 1) % 384
        return drafts

    monkeypatch.setattr(spec_decode.Proposer, "draft", draft)
    return state


@pytest.mark.parametrize(
    "setting",
    [
        {},
        {
            "max_num_batched_tokens": 6
        },  # chunked prefill beside speculating decodes; drafts cut to the budget
        {"num_kv_blocks": 18},  # preemption (speculation itself never preempts)
        {"max_num_seqs": 2},
    ],
)
@pytest.mark.parametrize(
    "corrupt", [0, 3, 1]
)  # every draft right, every third wrong, every draft wrong
def test_forced_drafts_keep_greedy_outputs(checkpoint_dirs, forced, setting, corrupt):
    path = checkpoint_dirs["mistral"]  # a sliding window: rollbacks must not disturb it
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = make_llm(path, None, **setting)
    prompts = prompts_for(base.engine.info.vocab_size)
    want = base.generate(prompts, params, use_tqdm=False)
    forced["truth"] = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, want)}
    forced["corrupt"] = corrupt
    llm = make_llm(path, NGRAM, **setting)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert outputs(got) == outputs(want)
    sched = llm.engine.scheduler
    assert sched.num_draft_tokens > 0
    assert (sched.num_accepted_tokens == 0) == (corrupt == 1)
    if "num_kv_blocks" in setting:
        assert llm.engine.stats().num_preemptions_total > 0
    assert_no_leaks(llm)


def test_prefix_hits_n_samples_stop_strings_and_max_tokens(llama_dir, forced):
    """Stops landing mid-draft: the tokens after them are never output (and their blocks freed)."""
    base = make_llm(llama_dir, None)
    prompts = prompts_for(base.engine.info.vocab_size)
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    truth = base.generate(prompts, plain, use_tqdm=False)
    forced["truth"] = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, truth)}
    texts = [o.outputs[0].text for o in truth]
    stops = [t[len(t) // 2 : len(t) // 2 + 2] for t in texts if len(t) > 4][:2]
    cases = [
        plain,
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # max_tokens inside a draft
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stops),
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            stop=stops,
            include_stop_str_in_output=True,
        ),
        SamplingParams(
            temperature=0, max_tokens=20, stop_token_ids=[truth[2].outputs[0].token_ids[5]]
        ),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2),
    ]
    llm = make_llm(llama_dir, NGRAM)
    shared = [prompts[-1] + p for p in prompts[:2]]  # prefix-cache hits on the second round
    for params in cases:
        want = base.generate(prompts + shared, params, use_tqdm=False)
        for p, o in zip(prompts + shared, want):
            forced["truth"].setdefault(tuple(p), list(o.outputs[0].token_ids))
        assert outputs(llm.generate(prompts + shared, params, use_tqdm=False)) == outputs(want), (
            params
        )
    assert llm.engine.stats().prefix_cache_hits_total > 0
    assert llm.engine.scheduler.num_accepted_tokens > 0
    assert_no_leaks(llm)


def test_seeded_sampling_is_unchanged_and_unseeded_rows_beside_it_work(llama_dir, forced):
    """A seeded request draws at each position from the stream position decoding one token at a
    time would use, so its tokens are the same with speculation; logit_bias, top-k/top-p/min-p
    apply to every draft row; a request asking logprobs (which does not speculate) keeps them."""
    seeded = [
        SamplingParams(
            temperature=1.0,
            top_k=20,
            top_p=0.9,
            min_p=0.02,
            seed=11,
            max_tokens=16,
            ignore_eos=True,
            logit_bias={5: 3.0, 6: -2.0},
        ),
        SamplingParams(temperature=0.7, seed=12, max_tokens=16, ignore_eos=True),
    ]
    base = make_llm(llama_dir, None)
    prompts = prompts_for(base.engine.info.vocab_size)[:2]
    want = [base.generate(prompts, p, use_tqdm=False) for p in seeded]
    forced["truth"] = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, want[0])}
    logprobs = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    want_lp = base.generate(prompts, logprobs, use_tqdm=False)
    llm = make_llm(llama_dir, NGRAM)
    for params, w in zip(seeded, want):
        assert outputs(llm.generate(prompts, params, use_tqdm=False)) == outputs(w)
    assert llm.engine.scheduler.num_accepted_tokens > 0
    mixed = llm.generate(prompts + prompts, [seeded[0]] * 2 + [logprobs] * 2, use_tqdm=False)
    assert outputs(mixed[:2]) == outputs(want[0])
    for got, ref in zip(mixed[2:], want_lp):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert {t: lp.logprob for t, lp in a.items()} == pytest.approx(
                {t: lp.logprob for t, lp in b.items()}
            )
    assert_no_leaks(llm)


def chi_square(a: dict, b: dict) -> tuple[float, int]:
    """Two-sample chi-square homogeneity statistic and its degrees of freedom."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        total = a.get(k, 0) + b.get(k, 0)
        for obs, n in ((a.get(k, 0), na), (b.get(k, 0), nb)):
            expected = total * n / (na + nb)
            stat += (obs - expected) ** 2 / expected
    return stat, len(keys) - 1


def critical(df: int, z: float = 3.7) -> float:
    """Wilson-Hilferty: the chi-square value with upper tail about 1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_unseeded_sampling_keeps_the_target_distribution(llama_dir, forced):
    """Joint frequencies of the first three tokens (top_k 3: 27 outcomes) over 1500 samples, with
    and without speculation, drafts being deliberately unlikely tokens (every draft corrupted).
    Accepting a draft whenever it is among the allowed tokens (a shortcut some implementations take)
    would output the drafts most of the time: the same statistic then explodes."""
    prompt = prompts_for(384)[2]
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True, n=1500)
    base = make_llm(llama_dir, None)
    greedy = (
        base.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    forced["truth"] = {tuple(prompt): list(greedy)}
    forced["corrupt"] = 2  # half the drafts wrong

    def counts(outs) -> dict:
        table: dict = {}
        for c in outs[0].outputs:
            table[tuple(c.token_ids)] = table.get(tuple(c.token_ids), 0) + 1
        return table

    want = counts(base.generate([prompt], params, use_tqdm=False))
    llm = make_llm(llama_dir, {**NGRAM, "max_batch_size": 256}, max_num_seqs=256)
    got = counts(llm.generate([prompt], params, use_tqdm=False))
    assert (
        llm.engine.scheduler.num_accepted_tokens > 100
        and llm.engine.scheduler.num_draft_tokens > 1000
    )
    stat, df = chi_square(want, got)
    assert stat < critical(df), (stat, df, want, got)
    drafts_always = {
        tuple(forced["truth"][tuple(prompt)]): 1500
    }  # what accepting every draft gives
    assert chi_square(want, drafts_always)[0] > 10 * critical(df)
    assert_no_leaks(llm)


def test_who_speculates(llama_dir, forced):
    """A request that opts out does not speculate, nor one short of min_tokens (EOS is banned there),
    nor any request while more sequences run than max_batch_size."""
    llm = make_llm(llama_dir, {**NGRAM, "max_batch_size": 2})
    prompts = prompts_for(llm.engine.info.vocab_size)
    forced["truth"] = {tuple(p): list(range(10, 40)) for p in prompts}
    sched = llm.engine.scheduler
    for params in (
        SamplingParams(max_tokens=8, min_tokens=8),
        SamplingParams(max_tokens=8, speculative=False),
    ):
        llm.generate(prompts[:1], params, use_tqdm=False)
        assert sched.num_draft_tokens == 0, params
    llm.generate(
        prompts, SamplingParams(max_tokens=8), use_tqdm=False
    )  # 5 running > max_batch_size 2
    assert sched.num_draft_tokens == 0
    llm.generate(
        prompts[:1], SamplingParams(max_tokens=8, min_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert sched.num_draft_tokens > 0  # min_tokens bans nothing when EOS is ignored anyway
    drafts = sched.num_draft_tokens
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, min_tokens=4), use_tqdm=False)
    assert sched.num_draft_tokens > drafts
    assert_no_leaks(llm)


def test_rejected_drafts_back_off(llama_dir, forced):
    """A request whose drafts keep failing verifies after 2, 4, 8, ... steps without drafts (and
    goes back to every step once one is accepted)."""
    llm = make_llm(llama_dir, NGRAM)
    prompt = prompts_for(llm.engine.info.vocab_size)[3]
    truth = (
        llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    forced["truth"], forced["corrupt"] = {tuple(prompt): list(truth)}, 1
    sched = llm.engine.scheduler
    got = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    assert got[0].outputs[0].token_ids == truth
    assert (
        sched.num_accepted_tokens == 0 and sched.num_verifications == 5
    )  # decode steps 1, 4, 9, 18, 35
    forced["corrupt"] = 0
    llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    assert sched.num_verifications > 5 and sched.num_accepted_tokens > 20
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(
            temperature=0,
            max_tokens=16,
            ignore_eos=True,
            presence_penalty=1.0,
            frequency_penalty=0.7,
        ),
        SamplingParams(
            temperature=1.0, max_tokens=16, ignore_eos=True, seed=5, frequency_penalty=1.5
        ),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3),
        SamplingParams(
            temperature=0.8,
            max_tokens=16,
            ignore_eos=True,
            seed=9,
            logprobs=0,
            presence_penalty=0.5,
        ),
    ],
)
def test_penalties_and_logprobs_with_speculation(llama_dir, forced, params):
    """Each draft row is penalized for the drafts before it, accepted drafts count as outputs for
    later steps, and a speculating request's logprobs are the target's at each of its positions."""
    base = make_llm(llama_dir, None)
    prompts = prompts_for(base.engine.info.vocab_size)
    want = base.generate(prompts, params, use_tqdm=False)
    forced["truth"] = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, want)}
    forced["corrupt"] = 4
    llm = make_llm(llama_dir, NGRAM)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.scheduler.num_accepted_tokens > 10
    if params.logprobs is not None:
        for g, w in zip(got, want):
            assert len(g.outputs[0].logprobs) == len(w.outputs[0].logprobs) == 16
            for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert a.keys() == b.keys()
                for t in a:
                    assert (
                        a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
                        and a[t].rank == b[t].rank
                    )
            assert g.outputs[0].cumulative_logprob == pytest.approx(
                w.outputs[0].cumulative_logprob, abs=1e-3
            )
    assert_no_leaks(llm)


@pytest.mark.parametrize("corrupt", [0, 3])
def test_structured_outputs_with_speculation(llama_dir, forced, corrupt):
    """Drafts are cut to what the grammar allows (short of its end), each draft row is masked with
    the grammar's state after the drafts before it, and the matcher takes the accepted drafts:
    seeded outputs equal those without speculation and always validate."""
    pytest.importorskip("xgrammar")
    import jsonschema

    from kvserve.engine.sampling_params import StructuredOutputs

    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
        },
        "required": ["id", "tags"],
    }
    specs = [
        StructuredOutputs(json=schema),
        StructuredOutputs(regex=r"[a-z]{2,6}@[a-z]{2,4}\\.(com|org)"),
        StructuredOutputs(choice=["yes", "no", "maybe so"]),
    ]
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=spec)
        for spec in specs
        for s in range(4)
    ]
    base = LLM(llama_dir, dtype="float32", device="cpu")
    prompts = [f"The quick brown fox {i}" for i in range(len(params))]
    want = base.generate(prompts, params, use_tqdm=False)
    forced["truth"] = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in want}
    forced["corrupt"] = corrupt
    llm = LLM(
        llama_dir, dtype="float32", device="cpu", speculative_config={**NGRAM, "max_batch_size": 64}
    )
    got = llm.generate(prompts, params, use_tqdm=False)
    assert outputs(got) == outputs(want)
    for out in got[:4]:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert llm.engine.scheduler.num_accepted_tokens > (20 if corrupt == 0 else 0)
    assert_no_leaks(llm)


def test_tensor_parallel_with_speculation(llama_dir, forced):
    """With 2 ranks the workers learn each step's accepted drafts (with rank 0's samples) and keep
    their batches in step: outputs equal those of the same 2 ranks without speculation."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    base = LLM(llama_dir, dtype="float32", device="cpu", tensor_parallel_size=2, block_size=4)
    try:
        prompts = prompts_for(base.engine.info.vocab_size)
        want = base.generate(prompts, params, use_tqdm=False)
    finally:
        base.shutdown()
    forced["truth"] = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, want)}
    forced["corrupt"] = 3
    llm = LLM(
        llama_dir,
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        block_size=4,
        speculative_config=NGRAM,
    )
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert llm.engine.scheduler.num_accepted_tokens > 10
        assert_no_leaks(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_abort_mid_speculation_frees_everything(llama_dir, forced, method):
    spec = {**NGRAM, "method": method, "model": llama_dir} if method == "draft_model" else NGRAM
    llm = make_llm(llama_dir, spec)
    engine = llm.engine
    prompts = prompts_for(engine.info.vocab_size)[:3]
    forced["truth"] = {tuple(p): list(range(20, 60)) for p in prompts}  # (draft_model ignores it)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    for _ in range(4):
        engine.step()
    assert engine.scheduler.num_draft_tokens > 0
    for i in range(3):
        engine.abort(f"r{i}")
    assert_no_leaks(llm)
    if method == "draft_model":
        draft = engine.scheduler.proposer
        assert draft.blocks.num_free_blocks == draft.blocks.num_blocks - 1 and not draft.computed


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.usefixtures("kernel_set")
def test_bf16_kernels_give_the_same_bits(tmp_path, forced, quantization):
    """Each token of a speculating chunk reaches attention as its own decode row, so on the CPU's bf16
    kernels (decoder stack, paged decode attention, int8 matmuls) every draft position is computed
    exactly as decoding one token at a time: same tokens and the same logprobs, bit for bit. (With
    the bf16 linear's AMX tiles off: on CPUs that have them, a row's last bit can depend on
    whether its step multiplies 8 rows or more, as `KVSERVE_CPU_AMX=0` documents.)"""
    from kvserve.models import cpu_ops

    amx = cpu_ops.set_amx(False)
    try:
        _same_bits(tmp_path, forced, quantization)
    finally:
        cpu_ops.set_amx(amx)


def _same_bits(tmp_path, forced, quantization):
    from checkpoints import make_checkpoint

    path = make_checkpoint(
        tmp_path / "hd32",
        "llama",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    kw = {"dtype": "bfloat16", "device": "cpu", "quantization": quantization}
    base = LLM(path, **kw)
    assert base.engine.runner.cpu_stack is not None
    prompts = prompts_for(base.engine.info.vocab_size)
    want = base.generate(prompts, params, use_tqdm=False)
    forced["truth"] = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, want)}
    forced["corrupt"] = 3
    llm = LLM(path, speculative_config=NGRAM, **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_accepted_tokens > 20
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in e.items()} for e in g.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in e.items()} for e in w.outputs[0].logprobs
        ]
    assert_no_leaks(llm)


# ---- a draft model ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_draft_model(llama_dir, tmp_path, draft):
    """The target as its own draft proposes its own greedy tokens (acceptance about 1); another
    random model with the same vocabulary proposes mostly wrong ones. Outputs are unchanged either
    way (greedy and seeded), and the draft's blocks are freed with each request."""
    from checkpoints import make_checkpoint

    draft_dir = (
        llama_dir
        if draft == "itself"
        else make_checkpoint(tmp_path / "draft", "llama", seed=7, num_hidden_layers=1)
    )
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, stop=["e"]),
    ]
    base = make_llm(llama_dir, None)
    prompts = prompts_for(base.engine.info.vocab_size)[:3]
    llm = make_llm(llama_dir, spec)
    sched = llm.engine.scheduler
    for p in params:
        assert outputs(llm.generate(prompts, p, use_tqdm=False)) == outputs(
            base.generate(prompts, p, use_tqdm=False)
        )
        if p.temperature == 0:  # greedy drafts against greedy verification
            acceptance = sched.num_accepted_tokens / sched.num_draft_tokens
            assert acceptance > 0.9 if draft == "itself" else acceptance < 0.5, acceptance
    proposer = sched.proposer
    assert (
        proposer.blocks.num_free_blocks == proposer.blocks.num_blocks - 1 and not proposer.computed
    )
    assert_no_leaks(llm)


def test_draft_model_with_another_vocabulary_is_refused(llama_dir, tmp_path):
    from checkpoints import make_checkpoint

    other = make_checkpoint(tmp_path / "big-vocab", "llama", vocab_size=400)
    with pytest.raises(ValueError, match="vocabulary of 400 tokens, the target 384"):
        make_llm(llama_dir, {"method": "draft_model", "model": other})


# ---- served ------------------------------------------------------------------------------------------------


def test_served_with_speculation(server_checkpoint, server):  # noqa: F811
    """`--speculative-config` (from the environment here): greedy completions equal the plain
    server's, the counters move in /metrics, and `"speculative": false` opts a request out."""
    import httpx

    from server_fixtures import ServerProcess, metric, scrape, wait_idle

    spec = ServerProcess(
        server_checkpoint, env={"KVSERVE_SPECULATIVE_CONFIG": json.dumps(NGRAM)}
    ).wait_ready()
    try:
        body = {
            "model": "x",
            "prompt": [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        }

        def complete(srv, **extra):
            response = httpx.post(
                srv.url + "/v1/completions",
                json={**body, "model": srv_model(srv), **extra},
                timeout=60,
            )
            response.raise_for_status()
            return response.json()["choices"][0]["text"], response.json()["usage"]

        def srv_model(srv):
            return httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]

        before = scrape(spec.url)
        assert metric(before, "kvserve:spec_decode_num_draft_tokens_total") == 0
        assert complete(spec, speculative=False) == complete(server)
        assert metric(scrape(spec.url), "kvserve:spec_decode_num_draft_tokens_total") == 0
        assert complete(spec) == complete(server)
        with httpx.stream(
            "POST",
            spec.url + "/v1/completions",
            timeout=60,
            json={**body, "model": srv_model(spec), "stream": True},
        ) as response:
            events = [
                json.loads(line[6:])
                for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert streamed == complete(server)[0]
        assert (
            len([e for e in events if e["choices"] and e["choices"][0]["text"]]) < 24
        )  # several tokens a delta
        after = wait_idle(spec.url)
        drafts = metric(after, "kvserve:spec_decode_num_draft_tokens_total")
        accepted = metric(after, "kvserve:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 < accepted <= drafts
        assert 0 < metric(after, "kvserve:spec_decode_num_drafts_total") <= drafts
    finally:
        spec.stop()


def test_log_line_reports_acceptance_once_drafts_exist():
    from kvserve.engine.outputs import EngineStats
    from kvserve.server.metrics import ServerMetrics

    stats = EngineStats(1, 0, 0.1, 100, 90, 10, 20, 0, 0, 0)
    metrics = ServerMetrics(None, "m")
    assert "draft" not in metrics.stats_line(stats)
    stats = EngineStats(
        1,
        0,
        0.1,
        100,
        90,
        10,
        20,
        0,
        0,
        0,
        spec_verifications_total=10,
        spec_draft_tokens_total=40,
        spec_accepted_tokens_total=30,
    )
    assert (
        "draft acceptance since start: 75.0% (3.00 accepted per verification)"
        in metrics.stats_line(stats)
    )
