"""Structured outputs and logit_bias in the engine (engine/structured_output/grammar.py,
engine/worker/logits_processors.py).

The model is a tiny random llama: left alone it emits noise, so every valid output here is the
grammar's doing. Sampling is at temperature 1 with many seeds.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import re
import threading

import jsonschema
import pytest

pytest.importorskip("xgrammar")

from kvserve.engine import LLM, AsyncLLM, EngineArgs, SamplingParams  # noqa: E402
from kvserve.engine.sampling_params import StructuredOutputs  # noqa: E402

# KVSERVE_TEST_DEVICE=cuda runs this file on a GPU (.ci/gpu_session.sh tests)
DEVICE = os.environ.get("KVSERVE_TEST_DEVICE", "cpu")
NUM_SEEDS = 16
MAX_TOKENS = 200

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "active": {"type": "boolean"},
                },
                "required": ["id", "active"],
            },
            "note": {"type": "string", "maxLength": 6},
        },
        "required": ["user"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "bb", "ccc"]},
                "minItems": 2,
                "maxItems": 4,
            },
            "points": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["tags", "points"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "exclusiveMinimum": 10, "maximum": 20},
        },
        "required": ["ratio", "count"],
    },
    "pattern_anyof": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 99},
                    {"type": "null"},
                    {"enum": ["none", "many"]},
                ]
            },
        },
        "required": ["code", "value"],
    },
    "optional": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 3},
        },
        "required": ["color"],
    },
}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", device=DEVICE)


def _generate(llm, params: list[SamplingParams], prompt="The quick brown fox"):
    return llm.generate([prompt] * len(params), params, use_tqdm=False)


def _seeded(spec: StructuredOutputs, **kw) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=MAX_TOKENS, structured_outputs=spec, **kw
        )
        for s in range(NUM_SEEDS)
    ]


def test_json_schema_outputs_validate(llm):
    names = sorted(SCHEMAS)  # one batch: every schema, many seeds
    outs = _generate(
        llm, [p for name in names for p in _seeded(StructuredOutputs(json=SCHEMAS[name]))]
    )
    for i, name in enumerate(names):
        group = outs[i * NUM_SEEDS : (i + 1) * NUM_SEEDS]
        assert len({o.outputs[0].text for o in group}) > 1, "seeds should give different outputs"
        for out in group:
            completion = out.outputs[0]
            assert completion.finish_reason == "stop", (name, completion.text)
            jsonschema.validate(json.loads(completion.text), SCHEMAS[name])


def test_json_object_regex_choice_grammar(llm):
    # any JSON object: a random model left alone nests and rambles, so a bias (which the grammar
    # overrides where it must) pushes it to close its strings and objects
    closers = {llm.tokenizer.convert_tokens_to_ids(t): 8.0 for t in ('"', "}")}
    json_object = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=MAX_TOKENS,
            logit_bias=closers,
            structured_outputs=StructuredOutputs(json_object=True),
        )
        for s in range(NUM_SEEDS)
    ]
    for out in _generate(llm, json_object):
        assert out.outputs[0].finish_reason == "stop"
        assert isinstance(json.loads(out.outputs[0].text), dict), out.outputs[0].text
    specs = [
        (
            StructuredOutputs(regex=r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"),
            lambda t: re.fullmatch(r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)", t),
        ),
        (
            StructuredOutputs(choice=["yes", "no", "Zürich 東京"]),
            lambda t: t in ("yes", "no", "Zürich 東京"),
        ),
        (
            StructuredOutputs(grammar='root ::= "(" [0-9] ("+" [0-9])* ")"'),
            lambda t: re.fullmatch(r"\([0-9](\+[0-9])*\)", t),
        ),
    ]
    params = [p for spec, _ in specs for p in _seeded(spec)]
    outs = _generate(llm, params)
    for i, out in enumerate(outs):
        check = specs[i // NUM_SEEDS][1]
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop" and check(text), text


def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm):
    plain = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=9, max_tokens=20, ignore_eos=True),
    ]
    alone = _generate(llm, plain)
    constrained = _seeded(StructuredOutputs(json=SCHEMAS["nested"]))[:3]
    mixed = _generate(
        llm, [constrained[0], plain[0], constrained[1], plain[1], constrained[2], plain[2]]
    )
    assert [o.outputs[0].token_ids for o in mixed[1::2]] == [o.outputs[0].token_ids for o in alone]
    # seeded constrained rows do not depend on their neighbours either
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == [
        o.outputs[0].token_ids for o in _generate(llm, constrained)
    ]
    for out in mixed[0::2]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["nested"])


def test_unconstrained_batches_build_nothing(llm):
    _generate(llm, [SamplingParams(max_tokens=4)])
    manager = llm.engine.structured
    num_compiles = manager.num_compiles
    engine = llm.engine
    assert engine.runner.logits_processors._bias is None
    # the same spec twice (keys in another order) compiles once
    a = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}
    b = {"required": ["x"], "properties": {"x": {"type": "boolean"}}, "type": "object"}
    _generate(
        llm,
        [
            SamplingParams(max_tokens=20, structured_outputs=StructuredOutputs(json=s))
            for s in (a, b)
        ],
    )
    assert manager.num_compiles == num_compiles + 1
    stats = engine.stats()
    assert (
        stats.grammar_compiles_total == manager.num_compiles
        and stats.grammar_compile_seconds_total > 0
    )
    assert stats.structured_requests_total >= 2 and stats.num_compiling == 0


def test_preemption_keeps_outputs_valid(llama_dir):
    llm = LLM(llama_dir, dtype="float32", device=DEVICE, block_size=4, num_kv_blocks=48)
    schema = SCHEMAS["arrays"]
    outs = _generate(
        llm,
        [p.replace(max_tokens=120) for p in _seeded(StructuredOutputs(json=schema))[:4]]
        + [SamplingParams(max_tokens=60, ignore_eos=True, seed=s) for s in range(3)],
    )
    assert llm.engine.stats().num_preemptions_total > 0
    for out in outs[:4]:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_n_samples_each_constrained(llm):
    params = SamplingParams(
        n=4,
        seed=3,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputs(json=SCHEMAS["optional"]),
    )
    out = _generate(llm, [params])[0]
    assert len(out.outputs) == 4 and len({c.text for c in out.outputs}) > 1
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMAS["optional"])


def test_stop_string_and_max_tokens_with_constraint(llm):
    spec = StructuredOutputs(choice=["alpha beta gamma"])
    out = _generate(llm, [SamplingParams(structured_outputs=spec, stop=[" beta"], max_tokens=50)])[
        0
    ].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("alpha", "stop", " beta")
    out = _generate(llm, [SamplingParams(structured_outputs=spec, max_tokens=2)])[0].outputs[0]
    assert out.finish_reason == "length" and "alpha beta gamma".startswith(out.text)


def test_logit_bias_removes_and_forces(llm):
    greedy = _generate(llm, [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)])[
        0
    ].outputs[0]
    banned = greedy.token_ids[0]
    out = _generate(
        llm,
        [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={banned: -100})],
    )[0].outputs[0]
    assert banned not in out.token_ids
    forced = 42
    outs = _generate(
        llm,
        [
            SamplingParams(
                temperature=1.0, seed=s, max_tokens=8, ignore_eos=True, logit_bias={forced: 100}
            )
            for s in range(3)
        ]
        + [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)],
    )
    for out in outs[:3]:
        assert out.outputs[0].token_ids == [forced] * 8
    assert outs[3].outputs[0].token_ids == greedy.token_ids  # the unbiased row is untouched
    # the grammar wins over a bias: +100 on a token it forbids changes nothing
    spec = StructuredOutputs(choice=["yes", "no"])
    out = _generate(
        llm, [SamplingParams(structured_outputs=spec, logit_bias={forced: 100}, max_tokens=10)]
    )[0]
    assert out.outputs[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(structured_outputs=dict(json={"type": "string"}, regex="a")), "exactly one of"),
        (dict(structured_outputs=dict()), "exactly one of"),
        (
            dict(
                structured_outputs=dict(
                    json={"type": "object", "properties": {"a": {"not": {"type": "null"}}}}
                )
            ),
            "'not' at #/properties/a",
        ),
        (dict(structured_outputs=dict(json="{not json")), "not valid JSON"),
        (dict(structured_outputs=dict(choice=[])), "choice"),
        (dict(structured_outputs=dict(regex="")), "regex"),
        (dict(structured_outputs=dict(jsonschema={})), "jsonschema"),
        (dict(structured_outputs="json"), "'json'"),
        (dict(logit_bias={5: 100.5}), "100.5"),
        (dict(logit_bias={-1: 1.0}), "-1"),
        (dict(logit_bias=[1, 2]), "[1, 2]"),
    ],
)
def test_bad_specs_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutputs(regex="[a-"), "Unclosed '['"),
        (StructuredOutputs(json={"type": "foo"}), 'Unsupported type "foo"'),
        (StructuredOutputs(grammar='root ::= "a" |'), "EBNF parser error"),
    ],
)
def test_compile_errors_fail_only_that_request(llm, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _generate(llm, [SamplingParams(structured_outputs=spec)])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.kv_cache_manager.num_blocks - 1
    with pytest.raises(
        ValueError, match=r"logit_bias token ids must be in \[0, 384\), got \[384\]"
    ):
        _generate(llm, [SamplingParams(logit_bias={384: 1.0})])


def test_slow_compile_stalls_nobody(llm):
    engine, manager = llm.engine, llm.engine.structured
    release = threading.Event()
    compile_fn = manager._compile

    def slow_compile(spec):
        assert release.wait(30)
        return compile_fn(spec)

    manager._compile = slow_compile
    try:
        spec = StructuredOutputs(choice=["slow", "slower"])
        engine.add_request("slow", "hi", SamplingParams(structured_outputs=spec, max_tokens=10))
        engine.add_request("fast", "hi", SamplingParams(max_tokens=5, ignore_eos=True))
        finished = []
        while "fast" not in finished:
            finished += [o.request_id for o in engine.step() if o.finished]
        assert (
            finished == ["fast"] and manager.has_pending
        )  # the constrained one is still compiling
    finally:
        release.set()
        manager._compile = compile_fn
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].text for o in outs] in (["slow"], ["slower"])


def test_abort_while_compiling_and_prefix_cache(llm):
    engine, manager = llm.engine, llm.engine.structured
    release = threading.Event()
    compile_fn = manager._compile
    manager._compile = lambda spec: release.wait(30) and compile_fn(spec)
    try:
        engine.add_request(
            "gone", "hi", SamplingParams(structured_outputs=StructuredOutputs(regex="a+b"))
        )
        assert engine.has_unfinished_requests()
        engine.abort("gone")
        assert not engine.has_unfinished_requests() and not manager.has_pending
    finally:
        release.set()
        manager._compile = compile_fn
    # a long shared prompt: the second request reuses the first one's blocks
    prompt = "Continuous batching lets new requests join a running batch at every step. " * 3
    spec = StructuredOutputs(json=SCHEMAS["arrays"])
    hits = engine.stats().prefix_cache_hits_total
    for seed in (1, 2):
        out = llm.generate(
            prompt,
            SamplingParams(seed=seed, max_tokens=MAX_TOKENS, structured_outputs=spec),
            use_tqdm=False,
        )[0]
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["arrays"])
    assert engine.stats().prefix_cache_hits_total > hits


def test_padded_model_vocab_is_masked(tmp_path):
    """A model vocabulary larger than the tokenizer's: the extra ids are never allowed."""
    import transformers

    from checkpoints import save_tokenizer, tiny_config

    num_tokens = len(save_tokenizer(tmp_path))
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config("llama", vocab_size=num_tokens + 64)
    )
    model.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), dtype="float32", device=DEVICE)
    assert llm.engine.info.vocab_size == num_tokens + 64
    extra = {num_tokens + i: 100.0 for i in range(0, 64, 7)}  # the model would pick these
    out = _generate(
        llm,
        [
            SamplingParams(
                seed=s,
                logit_bias=extra,
                max_tokens=20,
                structured_outputs=StructuredOutputs(regex="[a-c]{3}"),
            )
            for s in range(4)
        ],
    )
    for o in out:
        assert (
            re.fullmatch("[a-c]{3}", o.outputs[0].text) and max(o.outputs[0].token_ids) < num_tokens
        )


def test_params_pickle_and_async_engine(llama_dir):
    params = SamplingParams(
        seed=1,
        max_tokens=MAX_TOKENS,
        logit_bias={"7": -100},
        structured_outputs=StructuredOutputs(json=SCHEMAS["nested"]),
    )
    assert pickle.loads(pickle.dumps(params)) == params

    async def run():
        engine = AsyncLLM(EngineArgs(model=llama_dir, dtype="float32", device=DEVICE))
        try:
            final = None
            async for out in engine.generate("hello", params, "r1"):
                final = out
            with pytest.raises(ValueError, match="Unclosed"):
                async for _ in engine.generate(
                    "hello", SamplingParams(structured_outputs=StructuredOutputs(regex="[a-")), "r2"
                ):
                    pass
            return final
        finally:
            await engine.shutdown()

    final = asyncio.run(run())
    assert final.finished and final.outputs[0].finish_reason == "stop"
    assert 7 not in final.outputs[0].token_ids
    jsonschema.validate(json.loads(final.outputs[0].text), SCHEMAS["nested"])


@pytest.mark.parametrize("path", ["kernel", "fallback"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bitmask_apply_matches_xgrammar(monkeypatch, path, dtype):
    """kvserve's C++ kernel and its fallback (xgrammar's kernel after a broadcast fill of wholly
    banned words) give xgrammar's CPU result; on CUDA, xgrammar's CUDA kernel does."""
    import numpy as np
    import torch
    import xgrammar

    from kvserve.engine.core.step_record import GrammarBitmask
    from kvserve.engine.worker.logits_processors import apply_bitmask
    from kvserve.models import cpu_ops

    if path == "fallback":
        monkeypatch.setattr(cpu_ops, "apply_token_bitmask_", lambda *args: False)
    elif DEVICE == "cpu" and not cpu_ops.load():
        pytest.skip("the C++ CPU kernels did not build here")
    rng = np.random.default_rng(0)
    num_rows, vocab_size = 6, 1000  # not a multiple of 32
    for allowed_share in (0.001, 0.5, 0.99):
        bits = rng.random((num_rows, 1024)) < allowed_share
        bitmask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)  # [6, 32]
        logits = torch.randn(num_rows, vocab_size).to(getattr(torch, dtype))
        rows = (0, 2, 3, 5)
        expected = logits.float()
        xgrammar.apply_token_bitmask_inplace(
            expected, torch.from_numpy(bitmask.copy()), indices=list(rows)
        )
        logits = logits.to(DEVICE)
        apply_bitmask(logits, GrammarBitmask(rows, bitmask), torch.device(DEVICE))
        assert torch.equal(logits.float().cpu(), expected)


def test_bitmask_kernel_bans_ids_past_the_mask():
    """A bitmask narrower than the logits (a model vocabulary padded past the tokenizer's): the
    extra ids are banned; rows not listed are untouched."""
    import numpy as np
    import torch

    from kvserve.models import cpu_ops

    if not cpu_ops.load():
        pytest.skip("the C++ CPU kernels did not build here")
    logits = torch.zeros(3, 70)
    bitmask = np.full((3, 2), -1, np.int32)  # 64 ids allowed
    assert cpu_ops.apply_token_bitmask_(logits, torch.from_numpy(bitmask), torch.tensor([1]))
    assert torch.isinf(logits[1, 64:]).all() and (logits[1, :64] == 0).all()
    assert (logits[0] == 0).all() and (logits[2] == 0).all()
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.apply_token_bitmask_(logits, torch.from_numpy(bitmask), torch.tensor([3]))


def test_fill_threads_follow_the_device():
    """CPU: the forward's threads; GPU: half the host's cores (the fill overlaps the device), 2..8."""
    from kvserve.engine.structured_output.grammar import fill_threads_for

    assert fill_threads_for("cpu", 2, 16) == 2
    assert fill_threads_for("cpu", 0, 16) == 1
    assert fill_threads_for("cuda", 2, 16) == 8
    assert fill_threads_for("cuda", 2, 10) == 5
    assert fill_threads_for("cuda", 2, 2) == 2
    assert fill_threads_for("cuda", 2, 64) == 8
