"""Beam search (engine/beam_search.py): sequences and scores equal transformers'
`generate(num_beams=B, length_penalty=..., early_stopping=...)` on a decoder-only model, and
the KV blocks the beams share come back to the pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from checkpoints import make_checkpoint
from kvserve.engine import LLM
from kvserve.engine.beam_search import BeamSearchParams, beam_search
from server_fixtures import server, server_checkpoint, wait_idle  # noqa: F401  (pytest fixtures)

PROMPTS = [[5, 17, 42, 99, 7], [120, 3, 64], [11, 250, 31, 8, 77, 200, 19, 54, 23]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Llama whose EOS is a token it often produces, so that hypotheses end on EOS
    as well as on max_tokens."""
    path = make_checkpoint(tmp_path_factory.mktemp("beam") / "llama", "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    greedy = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4, do_sample=False)[
        0, len(PROMPTS[0]) :
    ]
    eos = int(greedy[2])
    config = json.loads((Path(path) / "config.json").read_text())
    config.update(eos_token_id=eos, pad_token_id=eos)
    (Path(path) / "config.json").write_text(json.dumps(config))
    (Path(path) / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": eos})
    )
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", device="cpu", block_size=4)


def hf_beams(
    hf, prompt: list[int], width: int, length_penalty: float, early_stopping
) -> list[tuple[list[int], float]]:
    out = hf.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    eos = hf.generation_config.eos_token_id
    beams = []
    for seq, score in zip(out.sequences, out.sequences_scores):
        generated = seq[len(prompt) :].tolist()
        if eos in generated:  # padded with EOS after the hypothesis' own EOS
            generated = generated[: generated.index(eos) + 1]
        beams.append((generated, float(score)))
    return beams


@pytest.mark.parametrize(
    "width,length_penalty,early_stopping",
    [(2, 1.0, False), (4, 1.0, False), (4, 0.5, True), (2, 2.0, "never"), (4, -1.0, False)],
)
def test_equals_transformers_generate(llm, hf_model, width, length_penalty, early_stopping):
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    ended_on_eos = 0
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf_beams(hf_model, prompt, width, length_penalty, early_stopping)
        got = [(seq.generated_tokens, seq.score) for seq in output.sequences]
        assert [g for g, _ in got] == [e for e, _ in expected]
        assert [s for _, s in got] == pytest.approx([s for _, s in expected], abs=1e-4)
        for seq in output.sequences:
            assert seq.tokens[: len(prompt)] == prompt
            assert seq.score == pytest.approx(
                seq.cum_logprob / len(seq.generated_tokens) ** length_penalty
            )
            ended_on_eos += seq.finish_reason == "stop"
    if length_penalty <= 1.0:  # (a large penalty favours the long hypotheses)
        assert ended_on_eos > 0  # the EOS path was taken somewhere


def test_blocks_come_back_and_text_is_decoded(llm):
    outputs = llm.beam_search(
        ["Hello there", "The fox"], BeamSearchParams(beam_width=3, max_tokens=6)
    )
    assert all(len(o.sequences) == 3 for o in outputs)
    for output in outputs:
        for seq in output.sequences:
            assert seq.text == llm.tokenizer.decode(seq.generated_tokens, skip_special_tokens=True)
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_ignore_eos_runs_every_hypothesis_to_max_tokens(llm):
    (output,) = llm.beam_search(
        [{"prompt_token_ids": PROMPTS[0]}],
        BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    assert [len(s.generated_tokens) for s in output.sequences] == [MAX_TOKENS] * 2
    assert {s.finish_reason for s in output.sequences} == {"length"}


def test_the_search_alone_on_a_known_distribution():
    """Two beams over a 3-token vocabulary with EOS = 0, by hand: step 1 keeps tokens 1 and 2;
    step 2 finishes "1, 0" (score -0.9 / 2) and continues the rest."""
    table = {
        (): {1: -0.2, 2: -0.5, 0: -3.0},
        (1,): {0: -0.7, 1: -1.0, 2: -2.0},
        (2,): {1: -0.1, 2: -0.9, 0: -4.0},
    }

    def scorer(owners, sequences, k):
        return [table.get(tuple(seq[1:]), {1: -1.5, 2: -1.6, 0: -1.7}) for seq in sequences]

    (out,) = beam_search([[9]], BeamSearchParams(beam_width=2, max_tokens=2), [0], scorer)
    assert [(s.generated_tokens, round(s.score, 6), s.finish_reason) for s in out.sequences] == [
        ([2, 1], round(-0.6 / 2, 6), "length"),
        ([1, 0], round(-0.9 / 2, 6), "stop"),
    ]


@pytest.mark.parametrize(
    "field,value",
    [
        ("beam_width", 0),
        ("beam_width", 11),
        ("max_tokens", 0),
        ("early_stopping", "sometimes"),
        ("length_penalty", "x"),
        ("length_penalty", 1e308),
    ],
)
def test_bad_params_name_the_field(field, value):
    kwargs = dict(beam_width=2, max_tokens=4)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


def test_prompt_too_long_for_the_context_is_refused(llm):
    with pytest.raises(ValueError):
        llm.beam_search(
            [{"prompt_token_ids": [5] * 500}], BeamSearchParams(beam_width=2, max_tokens=100)
        )
    stats = llm.engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


# ---------------------------------------------------------------- over HTTP (use_beam_search)


def test_served_completion_equals_the_offline_search(server, server_checkpoint):  # noqa: F811
    import httpx

    body = {
        "model": "tiny",
        "prompt": "The fox and the",
        "max_tokens": 8,
        "n": 3,
        "use_beam_search": True,
        "length_penalty": 0.8,
        "early_stopping": "never",
    }
    response = httpx.post(f"{server.base_url}/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    result = response.json()
    offline = LLM(server_checkpoint, dtype="float32", device="cpu")
    (expected,) = offline.beam_search(
        ["The fox and the"],
        BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.8, early_stopping="never"),
    )
    assert [c["text"] for c in result["choices"]] == [s.text for s in expected.sequences]
    assert [c["index"] for c in result["choices"]] == [0, 1, 2]
    assert [c["finish_reason"] for c in result["choices"]] == [
        s.finish_reason for s in expected.sequences
    ]
    assert result["usage"]["completion_tokens"] == sum(
        len(s.generated_tokens) for s in expected.sequences
    )
    wait_idle(server.url)


def test_served_chat_completion(server):  # noqa: F811
    import httpx

    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 6,
        "n": 2,
        "use_beam_search": True,
    }
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
    wait_idle(server.url)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"stream": True}, "stream"),
        ({"logprobs": 2}, "logprobs"),
        ({"temperature": 0.7}, "temperature"),
        ({"stop": ["x"]}, "stop"),
        ({"n": 11}, "n"),
        ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
    ],
)
def test_served_refuses_what_beam_search_cannot_honour(server, extra, param):  # noqa: F811
    import httpx

    body = {
        "model": "tiny",
        "prompt": "Hi",
        "max_tokens": 4,
        "n": 2,
        "use_beam_search": True,
        **extra,
    }
    response = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    wait_idle(server.url)
