"""Encoder-decoder models served by the engine (paged cache, continuous batching): greedy tokens
and logprobs equal transformers' `generate()` for BART, Marian and T5 (v1.0 and v1.1), with
ragged sources batched together, a pool tight enough to preempt, n > 1, and the same decoder
tokens under different sources; every KV block (cross blocks included) back in the pool after."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoints import save_tokenizer
from kvserve.engine import LLM, SamplingParams
from test_seq2seq_models import CONFIGS, random_checkpoint

VOCAB = 384  # the test tokenizer's


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(family, transformers model, checkpoint dir with a tokenizer)."""
    overrides = {"vocab_size": VOCAB}
    if request.param == "marian":  # its pad / decoder start: the last id
        overrides.update(pad_token_id=VOCAB - 1, decoder_start_token_id=VOCAB - 1)
    path = tmp_path_factory.mktemp(request.param)
    hf = random_checkpoint(request.param, path, **overrides)
    save_tokenizer(path)
    return request.param, hf, str(path)


def hf_greedy(hf, source: list[int], max_new: int) -> tuple[list[int], list[float]]:
    out = hf.generate(
        torch.tensor([source]),
        max_new_tokens=max_new,
        do_sample=False,
        num_beams=1,
        use_cache=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, 1:].tolist()
    logprobs = [
        float(torch.log_softmax(score[0].float(), -1)[t]) for score, t in zip(out.scores, tokens)
    ]
    eos = hf.generation_config.eos_token_id
    if eos in tokens:
        end = tokens.index(eos) + 1
        tokens, logprobs = tokens[:end], logprobs[:end]
    return tokens, logprobs


SOURCES = [
    [5, 17, 42, 99, 7, 250, 31],
    [120, 3],
    [11, 250, 31, 8, 77, 200, 19, 54, 23, 300, 64, 90, 12, 5, 6],
    [64, 64, 64, 9],
]


def check_against_hf(llm: LLM, hf, sources, max_new: int = 12) -> None:
    params = SamplingParams(max_tokens=max_new, temperature=0.0, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sources], params, use_tqdm=False)
    for source, out in zip(sources, outputs):
        expected, expected_lps = hf_greedy(hf, source, max_new)
        choice = out.outputs[0]
        assert choice.token_ids == expected, (source, choice.token_ids, expected)
        got_lps = [entry[t].logprob for entry, t in zip(choice.logprobs, choice.token_ids)]
        assert got_lps == pytest.approx(expected_lps, abs=1e-4)
        assert out.prompt_token_ids == source
    stats = llm.engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_greedy_equals_transformers(checkpoint):
    _, hf, path = checkpoint
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    check_against_hf(llm, hf, SOURCES)
    check_against_hf(llm, hf, SOURCES[::-1])  # again: decoder prefixes cached under other sources


def test_preemption_and_chunking(checkpoint):
    """A pool for about two requests and a budget that splits steps: requests are preempted
    (their decoder and cross blocks freed, the encoder run again when they resume)."""
    _, hf, path = checkpoint
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=14,
        max_num_batched_tokens=24,
    )
    check_against_hf(llm, hf, SOURCES)
    assert llm.engine.stats().num_preemptions_total > 0


def test_one_encoder_run_per_source(checkpoint):
    """The n samples of a request, requests with the same source running together, and later
    requests with a source whose encoder output is still cached (a retry, the next step of a beam
    search) share one encoder output (its cross blocks): the source is encoded once."""
    _, hf, path = checkpoint
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    expected, _ = hf_greedy(hf, SOURCES[0], 8)
    before = llm.engine.prompt_tokens_computed_total
    (out,) = llm.generate(
        [{"prompt_token_ids": SOURCES[0]}],
        SamplingParams(max_tokens=8, temperature=0.0, n=3),
        use_tqdm=False,
    )
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    outs = llm.generate(
        [{"prompt_token_ids": SOURCES[0]}] * 2 + [{"prompt_token_ids": SOURCES[1]}],
        SamplingParams(max_tokens=8, temperature=0.0),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs[:2]] == [expected] * 2
    # each source once (the first kept after its request finished), plus one decoder start token per sequence
    assert llm.engine.prompt_tokens_computed_total - before == len(SOURCES[0]) + len(SOURCES[1]) + 6
    before = llm.engine.prompt_tokens_computed_total
    llm.generate(
        [
            {"prompt_token_ids": SOURCES[0], "cache_salt": "a"},
            {"prompt_token_ids": SOURCES[0], "cache_salt": "b"},
        ],
        SamplingParams(max_tokens=2, temperature=0.0),
        use_tqdm=False,
    )
    # tenants with other cache salts never share an encoder output: each encodes its own
    assert llm.engine.prompt_tokens_computed_total - before == 2 * len(SOURCES[0]) + 2
    stats = llm.engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_kept_encoder_output_evicted_or_off(checkpoint):
    """A kept encoder output is a cache entry: when the pool needs its blocks they go (the source
    is encoded again, with the same result), and without prefix caching nothing is kept."""
    _, hf, path = checkpoint
    expected, _ = hf_greedy(hf, SOURCES[2], 6)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=14)
    for source in (SOURCES[2], SOURCES[0], SOURCES[3], SOURCES[1], SOURCES[2]):  # the pool cycles
        llm.generate([{"prompt_token_ids": source}], params, use_tqdm=False)
    before = llm.engine.prompt_tokens_computed_total
    (out,) = llm.generate([{"prompt_token_ids": SOURCES[2]}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == expected
    assert llm.engine.prompt_tokens_computed_total - before == 1  # kept: only the decoder start
    for source in SOURCES[:2] + SOURCES[3:] + SOURCES[:2]:  # evicts SOURCES[2]'s blocks
        llm.generate([{"prompt_token_ids": source}], params, use_tqdm=False)
    before = llm.engine.prompt_tokens_computed_total
    (out,) = llm.generate([{"prompt_token_ids": SOURCES[2]}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == expected
    assert llm.engine.prompt_tokens_computed_total - before == len(SOURCES[2]) + 1
    stats = llm.engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total

    llm = LLM(path, dtype="float32", device="cpu", block_size=4, enable_prefix_caching=False)
    for _ in range(2):
        before = llm.engine.prompt_tokens_computed_total
        (out,) = llm.generate([{"prompt_token_ids": SOURCES[2]}], params, use_tqdm=False)
        assert out.outputs[0].token_ids == expected
        assert llm.engine.prompt_tokens_computed_total - before == len(SOURCES[2]) + 1


@pytest.mark.parametrize("width,length_penalty,early_stopping", [(2, 1.0, False), (4, 0.6, True)])
def test_beam_search_equals_transformers(checkpoint, width, length_penalty, early_stopping):
    """Beams are decoder sequences over one source (sharing its encoder output and their prefixes):
    sequences and scores equal generate(num_beams=...)."""
    from kvserve.engine import BeamSearchParams

    _, hf, path = checkpoint
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    params = BeamSearchParams(
        beam_width=width, max_tokens=8, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outputs = llm.beam_search([{"prompt_token_ids": s} for s in SOURCES[:3]], params)
    eos = hf.generation_config.eos_token_id
    for source, output in zip(SOURCES[:3], outputs):
        out = hf.generate(
            torch.tensor([source]),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=8,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            do_sample=False,
            use_cache=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        expected = []
        for seq in out.sequences[:, 1:].tolist():
            expected.append(seq[: seq.index(eos) + 1] if eos in seq else seq)
        assert [s.generated_tokens for s in output.sequences] == expected
        assert [s.score for s in output.sequences] == pytest.approx(
            out.sequences_scores.tolist(), abs=1e-4
        )
    stats = llm.engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_decoder_prompt(checkpoint):
    """A decoder prefix (starting with the start token) is continued; a bad one is refused by name."""
    _, hf, path = checkpoint
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    expected, _ = hf_greedy(hf, SOURCES[0], 8)
    start = hf.config.decoder_start_token_id
    (out,) = llm.generate(
        [{"prompt_token_ids": SOURCES[0], "decoder_prompt_token_ids": [start] + expected[:3]}],
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    assert out.outputs[0].token_ids == expected[3:8]
    for bad in ([], [start, VOCAB + 5], [start + 1 if start + 1 < VOCAB else 0]):
        with pytest.raises(ValueError, match="decoder_prompt_token_ids"):
            llm.generate(
                [{"prompt_token_ids": SOURCES[0], "decoder_prompt_token_ids": bad}],
                SamplingParams(max_tokens=2),
                use_tqdm=False,
            )


def test_structured_outputs(checkpoint):
    """A regex and a choice constrain the decoder's output as they do a decoder-only model's."""
    import re

    from kvserve.engine.sampling_params import StructuredOutputs

    _, _, path = checkpoint
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, seed=i, structured_outputs=so)
        for i, so in enumerate(
            [StructuredOutputs(regex="[0-9]{3}-[a-z]{2}"), StructuredOutputs(choice=["yes", "no"])]
        )
    ]
    regex, choice = llm.generate(
        [{"prompt_token_ids": SOURCES[0]}, {"prompt_token_ids": SOURCES[2]}], params, use_tqdm=False
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.outputs[0].text), regex.outputs[0].text
    assert choice.outputs[0].text in ("yes", "no")
    stats = llm.engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_bad_sources_are_refused(checkpoint):
    _, _, path = checkpoint
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="source"):
        llm.generate(
            [{"prompt_token_ids": [5] * 5000}], SamplingParams(max_tokens=4), use_tqdm=False
        )
    stats = llm.engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_served_completion(checkpoint):
    """`kvserve serve` on the checkpoint: the source text as the prompt gives the offline engine's
    text, beam search the offline search's; a chat request without a chat template and prompt
    logprobs are 400s."""
    import httpx

    from server_fixtures import ServerProcess, wait_idle

    family, _, path = checkpoint
    if family != "bart":
        pytest.skip("one family over HTTP is enough: the engine tests cover the rest")
    tokenizer_config = (
        Path(path) / "tokenizer_config.json"
    )  # translation checkpoints have no chat template
    config = json.loads(tokenizer_config.read_text())
    config.pop("chat_template", None)
    tokenizer_config.write_text(json.dumps(config))
    (Path(path) / "chat_template.jinja").unlink(missing_ok=True)
    offline = LLM(path, dtype="float32", device="cpu")
    (expected,) = offline.generate(
        ["the fox and the crow"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
    )
    srv = ServerProcess(path).wait_ready()
    try:
        body = {"prompt": "the fox and the crow", "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"{srv.base_url}/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        result = response.json()
        assert result["choices"][0]["text"] == expected.outputs[0].text
        assert result["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
        chat = httpx.post(
            f"{srv.base_url}/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        )
        assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
        refused = httpx.post(
            f"{srv.base_url}/completions", json={**body, "echo": True, "logprobs": 1}, timeout=60
        )
        assert refused.status_code == 400, refused.text
        beams = httpx.post(
            f"{srv.base_url}/completions",
            json={**body, "n": 2, "use_beam_search": True},
            timeout=60,
        )
        assert beams.status_code == 200, beams.text
        from kvserve.engine import BeamSearchParams

        (offline_beams,) = offline.beam_search(
            ["the fox and the crow"], BeamSearchParams(beam_width=2, max_tokens=8)
        )
        assert [c["text"] for c in beams.json()["choices"]] == [
            s.text for s in offline_beams.sequences
        ]
        wait_idle(srv.url)
    finally:
        srv.stop()
