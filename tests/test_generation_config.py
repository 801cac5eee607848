"""A checkpoint's generation_config.json (engine/generation_config.py, docs/generation_config.md):
with every processor kvserve applies switched on, greedy tokens and beam search sequences and
scores equal transformers' `generate()` for Llama, BART and Marian (forced EOS at max length);
a request's own settings win; `generation_config="vllm"` ignores the file; bad values are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from checkpoints import make_checkpoint, save_tokenizer
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.beam_search import BeamSearchParams
from kvserve.engine.generation_config import load_generation_config, parse_generation_config
from kvserve.engine.generation_logits import banned_bad_words, banned_ngram_tokens
from kvserve.engine.sampling_params import GenerationConstraints
from test_seq2seq_models import random_checkpoint

PROMPTS = [[5, 17, 42, 99, 7], [120, 3, 64], [11, 250, 31, 8, 77, 200, 19, 54, 23]]
MAX_TOKENS = 12
VOCAB = 384


def write_generation_config(path: str | Path, **fields) -> None:
    (Path(path) / "generation_config.json").write_text(json.dumps(fields))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(checkpoint dir, transformers model): a tiny Llama whose EOS is a token it produces often;
    its generation config sets every processor, sampling defaults and beam settings."""
    path = make_checkpoint(tmp_path_factory.mktemp("genconf") / "llama", "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    greedy = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4, do_sample=False)[
        0, len(PROMPTS[0]) :
    ]
    eos = int(greedy[2])
    config = json.loads((Path(path) / "config.json").read_text())
    config.update(eos_token_id=eos, pad_token_id=eos)
    (Path(path) / "config.json").write_text(json.dumps(config))
    write_generation_config(
        path,
        eos_token_id=eos,
        pad_token_id=eos,
        no_repeat_ngram_size=2,
        bad_words_ids=[[int(greedy[0])], [int(greedy[1]), int(greedy[3])]],
        min_new_tokens=3,
        min_length=7,
        forced_eos_token_id=eos,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        repetition_penalty=1.1,
        num_beams=3,
        length_penalty=0.8,
        early_stopping=True,
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def hf_greedy(hf, prompt: list[int], max_new: int, **kwargs) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        do_sample=False,
        num_beams=1,
        repetition_penalty=1.0,
        **kwargs,
    )
    generated = (
        out[0, len(prompt) :].tolist() if not hf.config.is_encoder_decoder else out[0, 1:].tolist()
    )
    eos = hf.generation_config.eos_token_id
    return generated[: generated.index(eos) + 1] if eos in generated else generated


def hf_beams(hf, prompt: list[int], max_new: int) -> list[tuple[list[int], float]]:
    """generate() with the checkpoint's num_beams, length_penalty, early_stopping and processors."""
    width = hf.generation_config.num_beams
    out = hf.generate(
        torch.tensor([prompt]),
        num_return_sequences=width,
        max_new_tokens=max_new,
        do_sample=False,
        repetition_penalty=1.0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    eos = hf.generation_config.eos_token_id
    start = 1 if hf.config.is_encoder_decoder else len(prompt)
    beams = []
    for seq, score in zip(out.sequences, out.sequences_scores):
        generated = seq[start:].tolist()
        if eos in generated:
            generated = generated[: generated.index(eos) + 1]
        beams.append((generated, float(score)))
    return beams


def check_greedy(llm: LLM, hf, prompts, max_new: int, **params) -> list[list[int]]:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=max_new, temperature=0.0, logprobs=2, **params),
        use_tqdm=False,
    )
    got = [out.outputs[0].token_ids for out in outputs]
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf, prompt, max_new), prompt
    return got


def check_beams(llm: LLM, hf, prompts, max_new: int) -> None:
    outputs = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        llm.get_default_beam_search_params(max_tokens=max_new),
    )
    for prompt, output in zip(prompts, outputs):
        expected = hf_beams(hf, prompt, max_new)
        got = [(seq.generated_tokens, seq.score) for seq in output.sequences]
        assert [t for t, _ in got] == [t for t, _ in expected], prompt
        assert [s for _, s in got] == pytest.approx([s for _, s in expected], abs=1e-4)


def test_llama_greedy_and_beams_equal_generate(llama):
    path, hf = llama
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    c = llm.engine.info.generation_config.constraints
    assert c.no_repeat_ngram_size == 2 and c.min_new_tokens == 3 and c.forced_eos_token_ids
    got = check_greedy(llm, hf, PROMPTS, MAX_TOKENS)
    for tokens in got:  # the processors did something: no bigram twice, EOS last at max_tokens
        assert len({tuple(tokens[i : i + 2]) for i in range(len(tokens) - 1)}) == len(tokens) - 1
    check_greedy(llm, hf, PROMPTS, 5)  # forced EOS and min_new_tokens at once near the end
    check_beams(llm, hf, PROMPTS, 8)
    assert llm.engine.stats().num_kv_blocks_free == llm.engine.stats().num_kv_blocks_total


def test_sampling_defaults_and_request_overrides(llama):
    path, hf = llama
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty) == (
        0.7,
        0.9,
        20,
        1.1,
    )
    beams = llm.get_default_beam_search_params()
    assert (beams.beam_width, beams.length_penalty, beams.early_stopping) == (3, 0.8, True)
    # a request's own constraints replace the checkpoint's: none at all equals generate() without them
    off = dict(
        no_repeat_ngram_size=0,
        bad_words_ids=None,
        min_new_tokens=0,
        min_length=0,
        forced_eos_token_id=None,
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, generation_constraints=GenerationConstraints()
        ),
        use_tqdm=False,
    )
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS, **off)
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate(
            [1, 2],
            SamplingParams(generation_constraints=GenerationConstraints(bad_words_ids=((10**6,),))),
        )


def test_vllm_mode_ignores_the_file(llama):
    path, hf = llama
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, generation_config="vllm")
    assert llm.engine.info.generation_config.constraints is None
    assert llm.get_default_sampling_params() == SamplingParams()
    off = dict(
        no_repeat_ngram_size=0,
        bad_words_ids=None,
        min_new_tokens=0,
        min_length=0,
        forced_eos_token_id=None,
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        use_tqdm=False,
    )
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS, **off)
    # a folder of its own: that folder's file
    folder = Path(path).parent / "other"
    folder.mkdir(exist_ok=True)
    write_generation_config(folder, temperature=0.3)
    g = load_generation_config(str(folder), path, VOCAB, (0,))
    assert g.sampling_defaults == {"temperature": 0.3} and g.constraints is None
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_generation_config(str(Path(path).parent / "missing"), path, VOCAB, (0,))


@pytest.fixture(scope="module", params=["bart", "marian"])
def seq2seq(request, tmp_path_factory):
    family = request.param
    overrides = {"vocab_size": VOCAB}
    if family == "marian":
        overrides.update(pad_token_id=VOCAB - 1, decoder_start_token_id=VOCAB - 1)
    path = tmp_path_factory.mktemp(family)
    hf = random_checkpoint(family, path, **overrides)
    save_tokenizer(path)
    eos = hf.config.eos_token_id
    if family == "marian":  # as opus-mt ships it: the pad id banned, EOS forced at max length
        fields = dict(
            bad_words_ids=[[VOCAB - 1]],
            forced_eos_token_id=eos,
            num_beams=4,
            no_repeat_ngram_size=3,
        )
    else:  # as mBART-50 / NLLB: a target language token forced first
        fields = dict(
            forced_bos_token_id=250,
            forced_eos_token_id=eos,
            no_repeat_ngram_size=2,
            min_length=6,
            num_beams=3,
            length_penalty=1.5,
        )
    write_generation_config(
        path,
        decoder_start_token_id=hf.config.decoder_start_token_id,
        eos_token_id=eos,
        pad_token_id=hf.config.pad_token_id,
        bos_token_id=hf.config.bos_token_id,
        **fields,
    )
    hf.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return family, hf, str(path)


SOURCES = [
    [5, 17, 42, 99, 7, 250, 31],
    [120, 3],
    [11, 250, 31, 8, 77, 200, 19, 54, 23, 300, 64, 90, 12, 5, 6],
]


def test_seq2seq_greedy_and_beams_equal_generate(seq2seq):
    family, hf, path = seq2seq
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    got = check_greedy(llm, hf, SOURCES, 6)
    eos = hf.config.eos_token_id
    assert all(tokens[-1] == eos for tokens in got)  # forced at max length, or chosen
    if family == "bart":
        assert all(tokens[0] == 250 for tokens in got)  # forced BOS
    check_greedy(llm, hf, SOURCES, 10)
    check_beams(llm, hf, SOURCES, 6)


def test_no_repeat_ngram_equals_transformers_processor():
    rng = np.random.default_rng(0)
    for size in (1, 2, 3, 4):
        tokens = rng.integers(0, 6, size=30)
        processor = transformers.NoRepeatNGramLogitsProcessor(size)
        scores = processor(torch.tensor(tokens[None]), torch.zeros(1, 6))
        expected = sorted(torch.nonzero(scores[0] == float("-inf")).flatten().tolist())
        assert sorted(set(banned_ngram_tokens(tokens, size).tolist())) == expected
    assert banned_bad_words(np.array([4, 5, 6]), ((9,), (5, 6, 7), (6, 8), (4, 6, 1))) == [9, 7, 8]


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be >= 0"),
        ({"no_repeat_ngram_size": 2.5}, "no_repeat_ngram_size must be an integer"),
        ({"bad_words_ids": [[1], []]}, "bad_words_ids must be a list of non-empty lists"),
        ({"bad_words_ids": [[1, 999]]}, "bad_words_ids must be"),
        ({"forced_bos_token_id": 384}, r"forced_bos_token_id must be a token id in \[0, 384\)"),
        ({"forced_eos_token_id": "x"}, "forced_eos_token_id must be"),
        ({"min_length": True}, "min_length must be an integer"),
        ({"num_beams": 0}, "num_beams must be >= 1"),
        ({"early_stopping": "sometimes"}, "early_stopping must be"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"length_penalty": "long"}, "length_penalty must be a finite number"),
    ],
)
def test_bad_values_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        parse_generation_config(fields, "generation_config.json", VOCAB, (0,))


def test_bad_file_fails_the_engine_start(tmp_path):
    path = make_checkpoint(tmp_path / "llama", "llama")
    write_generation_config(path, no_repeat_ngram_size=-2)
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        LLM(path, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="generation_config must be"):
        LLM(path, dtype="float32", device="cpu", generation_config="")


def test_do_sample_false_makes_greedy_the_default():
    g = parse_generation_config(
        {"do_sample": False, "temperature": 0.6, "top_p": 0.9}, "f", VOCAB, (0,)
    )
    assert (
        g.default_sampling_params().temperature == 0.0 and g.default_sampling_params().top_p == 1.0
    )
    g = parse_generation_config(
        {"bad_words_ids": [[0], [3]]}, "f", VOCAB, (0,)
    )  # an EOS alone is dropped
    assert g.constraints.bad_words_ids == ((3,),)


def test_startup_log_names_the_defaults(llama, caplog):
    path, _ = llama
    with caplog.at_level("INFO", logger="kvserve.engine.llm_engine"):
        LLM(path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    line = next(r.getMessage() for r in caplog.records if "generation config" in r.getMessage())
    assert (
        "Default sampling parameters have been overridden by the model's generation config" in line
    )
    assert "temperature=0.7" in line and "no_repeat_ngram_size=2" in line


def test_server_uses_the_checkpoint_defaults(llama):
    """Over HTTP: the sampling fields a request leaves out are the checkpoint's, those it sets win;
    greedy completions and beam search get the processors (as offline)."""
    from fastapi.testclient import TestClient

    from kvserve.engine import AsyncLLM, EngineArgs
    from kvserve.server.app import create_app
    from kvserve.server.config import ServerConfig
    from kvserve.server.protocol import CompletionRequest
    from kvserve.server.validation import validate_completion

    path, _ = llama
    args = dict(model=path, dtype="float32", device="cpu", block_size=4)
    llm = LLM(**args)
    engine = AsyncLLM(EngineArgs(**args), wait=False)
    with TestClient(
        create_app(ServerConfig(stats_log_interval=0), engine=engine, owns_engine=True)
    ) as client:
        limits = client.app.state.kv.limits
        vreq = validate_completion(
            CompletionRequest(prompt=PROMPTS[0], max_tokens=4), limits, llm.tokenizer
        )
        p = vreq.params
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.7, 0.9, 20, 1.1)
        vreq = validate_completion(
            CompletionRequest(prompt=PROMPTS[0], max_tokens=4, temperature=0.2, top_k=-1),
            limits,
            llm.tokenizer,
        )
        assert (vreq.params.temperature, vreq.params.top_k, vreq.params.top_p) == (0.2, -1, 0.9)
        body = {
            "prompt": PROMPTS[2],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "repetition_penalty": 1.0,
        }
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        (expected,) = llm.generate(
            [{"prompt_token_ids": PROMPTS[2]}],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
            use_tqdm=False,
        )
        assert response.json()["choices"][0]["text"] == expected.outputs[0].text
        body = {"prompt": PROMPTS[1], "max_tokens": 8, "n": 3, "use_beam_search": True}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        (offline,) = llm.beam_search(
            [{"prompt_token_ids": PROMPTS[1]}],
            BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.8, early_stopping=True),
        )  # the checkpoint's settings
        assert [c["text"] for c in response.json()["choices"]] == [
            s.text for s in offline.sequences
        ]
