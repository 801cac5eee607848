"""Embeddings: `LLM.embed` equals transformers' final hidden states pooled (last and mean, fp32 1e-4) with
chunked prefill and ragged batches, beside generating requests and under preemption; a bare
`Qwen3Model` checkpoint in sentence-transformers' layout serves embeddings only; /v1/embeddings through
the openai SDK (float and base64, batches, token ids) and its 4xx answers; no KV block left behind."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from checkpoints import make_checkpoint, save_tokenizer, tiny_config
from kvserve.engine import LLM, PoolingParams, SamplingParams
from server_fixtures import ServerProcess, server, server_checkpoint, wait_idle  # noqa: F401

PROMPTS = [list(range(3, 33)), [7, 8, 9], [11], list(range(40, 53)), "Hello there, how are you?"]


def hf_embedding(
    hf_model, token_ids: list[int], pooling: str, normalize: bool = True
) -> torch.Tensor:
    """transformers' reference: the base model's last hidden state (after the final norm), pooled."""
    with torch.no_grad():
        hidden = hf_model(torch.tensor([token_ids])).last_hidden_state[0]  # [S, hidden]
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def assert_free(llm: LLM) -> None:
    bm = llm.engine.kv_cache_manager
    assert bm.num_free_blocks == bm.num_blocks - 1  # every block back (block 0 is the null block)
    assert not llm.engine.scheduler.has_unfinished()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("qwen3") / "ck", "qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # a small step budget: the 30-token prompt takes four steps (chunked prefill)
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=8,
        block_size=4,
        num_kv_blocks=64,
    )
    yield path, hf.model, llm
    llm.shutdown()


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embed_equals_transformers(qwen3, pooling, normalize):
    _, hf_model, llm = qwen3
    outputs = llm.embed(
        PROMPTS, PoolingParams(pooling_type=pooling, normalize=normalize), use_tqdm=False
    )
    assert len(outputs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert out.prompt_token_ids == ids and out.finished
        ours = torch.tensor(out.outputs.embedding)
        assert ours.shape == (hf_model.config.hidden_size,)
        torch.testing.assert_close(
            ours, hf_embedding(hf_model, ids, pooling, normalize), atol=1e-4, rtol=1e-4
        )
    assert_free(llm)


def test_embed_defaults_and_generation_beside(qwen3):
    """Defaults: last token, normalized. Embedding and generating requests share steps; generation is unchanged."""
    _, hf_model, llm = qwen3
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    alone = llm.generate([PROMPTS[0], PROMPTS[3]], greedy, use_tqdm=False)
    engine = llm.engine
    engine.add_request("gen-a", PROMPTS[0], greedy)
    engine.add_request("emb-a", PROMPTS[0], PoolingParams())
    engine.add_request("gen-b", PROMPTS[3], greedy)
    engine.add_request("emb-b", PROMPTS[1], PoolingParams(pooling_type="mean"))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step(finished_only=True):
            done[out.request_id] = out
    assert [done[r].outputs[0].token_ids for r in ("gen-a", "gen-b")] == [
        o.outputs[0].token_ids for o in alone
    ]
    vector = np.frombuffer(done["emb-a"].embedding, "<f4")
    np.testing.assert_allclose(
        vector, hf_embedding(hf_model, PROMPTS[0], "last").numpy(), atol=1e-4
    )
    vector = np.frombuffer(done["emb-b"].embedding, "<f4")
    np.testing.assert_allclose(
        vector, hf_embedding(hf_model, PROMPTS[1], "mean").numpy(), atol=1e-4
    )
    assert_free(llm)


def test_embed_under_preemption(qwen3):
    """A pool too small for the batch preempts mid-prefill: mean pooling restarts from zero, still exact."""
    path, hf_model, _ = qwen3
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=16,
        block_size=4,
        num_kv_blocks=14,
    )
    try:
        prompts = [list(range(3, 33)), list(range(50, 80)), list(range(90, 110))]
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        engine = llm.engine
        engine.add_request(
            "gen", [5, 6, 7, 8], greedy
        )  # two decoding requests keep growing: they preempt
        engine.add_request("gen2", [5, 6, 7, 9, 10, 11, 12, 13], greedy)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"emb-{i}", prompt, PoolingParams(pooling_type="mean"))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step(finished_only=True):
                done[out.request_id] = out
        assert engine.scheduler.num_preemptions > 0
        for i, prompt in enumerate(prompts):
            np.testing.assert_allclose(
                np.frombuffer(done[f"emb-{i}"].embedding, "<f4"),
                hf_embedding(hf_model, prompt, "mean").numpy(),
                atol=1e-4,
            )
        assert_free(llm)
    finally:
        llm.shutdown()


def test_embed_tensor_parallel(qwen3):
    """Two ranks (CPU processes): rank 0 pools its full hidden states; the workers skip the embedding rows."""
    path, hf_model, _ = qwen3
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=8,
        block_size=4,
        num_kv_blocks=64,
        tensor_parallel_size=2,
    )
    try:
        greedy = SamplingParams(max_tokens=4, temperature=0.0)
        outputs = llm.embed(PROMPTS[:4], PoolingParams(pooling_type="mean"), use_tqdm=False)
        for prompt, out in zip(PROMPTS, outputs):
            torch.testing.assert_close(
                torch.tensor(out.outputs.embedding),
                hf_embedding(hf_model, prompt, "mean"),
                atol=1e-4,
                rtol=1e-4,
            )
        assert (
            llm.generate([PROMPTS[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids
        )  # the ranks agree after
        assert_free(llm)
    finally:
        llm.shutdown()


def test_embed_refuses_bad_input(qwen3):
    _, _, llm = qwen3
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed([[5] * 513])  # the checkpoint's context: 512
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(["hi"], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="pooling_type"):
        llm.embed(["hi"], PoolingParams(pooling_type="cls"))
    assert_free(llm)


# ---- a bare decoder checkpoint, as sentence-transformers saves Qwen3-Embedding ----


def save_embedding_checkpoint(path: Path, pooling_mode: str = "pooling_mode_lasttoken") -> Path:
    """`Qwen3Model` weights (no LM head, no `model.` prefix) plus sentence-transformers' module files."""
    config = tiny_config("qwen3", vocab_size=384, tie_word_embeddings=True)
    config.architectures = ["Qwen3Model"]
    torch.manual_seed(0)
    transformers.Qwen3Model(config).save_pretrained(path)
    save_tokenizer(path)
    (path / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, pooling_mode: True})
    )
    return path


@pytest.fixture(scope="module")
def embedding_checkpoint(tmp_path_factory) -> Path:
    return save_embedding_checkpoint(tmp_path_factory.mktemp("qwen3_embedding") / "ck")


def test_bare_qwen3_model_embeds(embedding_checkpoint, tmp_path):
    from safetensors import safe_open

    with safe_open(str(embedding_checkpoint / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "embed_tokens.weight" in names and not any(
        n.startswith(("model.", "lm_head")) for n in names
    )
    hf_model = transformers.AutoModel.from_pretrained(
        embedding_checkpoint, dtype=torch.float32
    ).eval()
    llm = LLM(str(embedding_checkpoint), dtype="float32", device="cpu", max_num_batched_tokens=8)
    try:
        assert llm.engine.info.task == "embed"  # found from the checkpoint
        for prompt, out in zip(
            PROMPTS, llm.embed(PROMPTS, use_tqdm=False)
        ):  # its default: last token, normalized
            ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            torch.testing.assert_close(
                torch.tensor(out.outputs.embedding),
                hf_embedding(hf_model, ids, "last"),
                atol=1e-4,
                rtol=1e-4,
            )
        with pytest.raises(ValueError, match="embeddings only"):
            llm.generate(["hi"])
        assert_free(llm)
    finally:
        llm.shutdown()
    mean_dir = save_embedding_checkpoint(tmp_path / "mean", "pooling_mode_mean_tokens")
    llm = LLM(str(mean_dir), dtype="float32", device="cpu")
    try:
        out = llm.embed([PROMPTS[0]], use_tqdm=False)[0]
        torch.testing.assert_close(
            torch.tensor(out.outputs.embedding),
            hf_embedding(hf_model, PROMPTS[0], "mean"),
            atol=1e-4,
            rtol=1e-4,
        )
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="only embed"):
        LLM(str(embedding_checkpoint), dtype="float32", device="cpu", task="generate")


def test_qwen3_embedding_layout(embedding_checkpoint, tmp_path):
    """Qwen3-Embedding's own layout: config.json names Qwen3ForCausalLM (untied, as the 8B's), the weights
    are the bare decoder's (no `model.` prefix, no LM head), sentence-transformers' modules.json beside."""
    path = tmp_path / "qwen3_embedding"
    shutil.copytree(embedding_checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps({**config, "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": False})
    )
    hf_model = transformers.AutoModel.from_pretrained(
        embedding_checkpoint, dtype=torch.float32
    ).eval()
    llm = LLM(str(path), dtype="float32", device="cpu")
    try:
        assert llm.engine.info.task == "embed"
        out = llm.embed([PROMPTS[3]], use_tqdm=False)[0]
        torch.testing.assert_close(
            torch.tensor(out.outputs.embedding),
            hf_embedding(hf_model, PROMPTS[3], "last"),
            atol=1e-4,
            rtol=1e-4,
        )
    finally:
        llm.shutdown()


def test_matryoshka_dimensions(tmp_path):
    """A checkpoint declaring Matryoshka dimensions may be cut (then normalized); other sizes are refused."""
    path = save_embedding_checkpoint(tmp_path / "mrl")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    hf_model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", device="cpu")
    try:
        out = llm.embed([PROMPTS[1]], PoolingParams(dimensions=16), use_tqdm=False)[0]
        expected = hf_embedding(hf_model, PROMPTS[1], "last", normalize=False)[:16]
        torch.testing.assert_close(
            torch.tensor(out.outputs.embedding),
            torch.nn.functional.normalize(expected, dim=-1),
            atol=1e-4,
            rtol=1e-4,
        )
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed([PROMPTS[1]], PoolingParams(dimensions=20))
    finally:
        llm.shutdown()


# ---- /v1/embeddings on a real server ----


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(server_checkpoint):  # noqa: F811
    llm = LLM(server_checkpoint, dtype="float32", device="cpu")
    yield llm
    llm.shutdown()


def test_server_embeddings_float_and_base64(server, client, offline):  # noqa: F811
    texts = ["The quick brown fox", "jumps", "over the lazy dog, again and again"]
    expected = [o.outputs.embedding for o in offline.embed(texts, use_tqdm=False)]
    result = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert [d.index for d in result.data] == [0, 1, 2] and result.model == "tiny"
    for data, vector in zip(result.data, expected):
        np.testing.assert_allclose(data.embedding, vector, atol=1e-5)
        assert abs(np.linalg.norm(data.embedding) - 1) < 1e-5
    assert result.usage.prompt_tokens == sum(len(offline.tokenizer.encode(t)) for t in texts)
    assert result.usage.total_tokens == result.usage.prompt_tokens
    raw = httpx.post(
        server.url + "/v1/embeddings",
        json={"input": texts[0], "encoding_format": "base64"},
        timeout=60,
    ).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, expected[0], atol=1e-5)
    by_sdk = client.embeddings.create(
        model="tiny", input=texts[1]
    )  # the SDK asks for base64 and decodes it
    np.testing.assert_allclose(by_sdk.data[0].embedding, expected[1], atol=1e-5)
    wait_idle(server.url)


def test_server_embeddings_token_ids(server, client, offline):  # noqa: F811
    ids = [[5, 6, 7, 8], [9, 10]]
    expected = [o.outputs.embedding for o in offline.embed(ids, use_tqdm=False)]
    result = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    for data, vector in zip(result.data, expected):
        np.testing.assert_allclose(data.embedding, vector, atol=1e-5)
    assert result.usage.prompt_tokens == 6
    one = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, expected[0], atol=1e-5)
    raw = httpx.post(
        server.url + "/v1/embeddings", json={"input": "hi", "normalize": False}, timeout=60
    ).json()
    assert abs(np.linalg.norm(raw["data"][0]["embedding"]) - 1) > 1e-3
    wait_idle(server.url)


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ["ok", ""]}, 400, "input"),
        ({"input": [[1, 2], []]}, 400, "input"),
        ({"input": [5] * 1025}, 400, "input"),  # the context is 1024
        ({"input": [10**6]}, 400, "input"),
        ({"input": "hi", "dimensions": 8}, 400, "dimensions"),
        ({"input": "hi", "encoding_format": "hex"}, 400, "encoding_format"),
        ({"input": "hi", "model": "nope"}, 404, "model"),
        ({}, 400, "input"),
    ],
)
def test_server_embeddings_bad_input(server, body, status, param):  # noqa: F811
    response = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    wait_idle(server.url)


def test_server_task_embed(embedding_checkpoint):
    srv = ServerProcess(
        str(embedding_checkpoint), "--task", "embed", "--served-model-name", "emb"
    ).wait_ready()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        result = client.embeddings.create(
            model="emb", input=["a b c", "d"], encoding_format="float"
        )
        assert len(result.data) == 2 and len(result.data[0].embedding) == 64
        for path, body in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            response = httpx.post(srv.url + path, json=body, timeout=60)
            assert response.status_code == 400, response.text
            assert "embeddings only" in response.json()["error"]["message"]
        wait_idle(srv.url)
    finally:
        srv.stop()


def test_encoder_decoder_cannot_embed(tmp_path):
    """A model that cannot embed: `LLM.embed` raises, and the route's check answers 400 naming `model`."""
    from kvserve.server.embeddings import EmbeddingRequest, pooling_params
    from kvserve.server.errors import APIError
    from test_seq2seq_models import random_checkpoint

    random_checkpoint("bart", tmp_path, vocab_size=384)
    save_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    try:
        with pytest.raises(ValueError, match="cannot compute embeddings"):
            llm.embed(["hello"])
        with pytest.raises(APIError) as err:
            pooling_params(EmbeddingRequest(input="hello"), llm.engine.info)
        assert err.value.status_code == 400 and err.value.param == "model"
    finally:
        llm.shutdown()
