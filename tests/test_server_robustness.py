"""The API key's scheme name, the default admission queue bound, and the prompt-token counters."""

from __future__ import annotations

import uuid

import httpx
import pytest
from fastapi.testclient import TestClient

from kvserve.server.config import ServerConfig
from kvserve.server.middleware import bearer_token
from server_fixtures import metric, scrape, server, server_checkpoint  # noqa: F401  (pytest fixtures)
from test_server_unit import FakeEngine


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from checkpoints import save_tokenizer

    return save_tokenizer(tmp_path_factory.mktemp("robustness_tokenizer"))


# --------------------------------------------------------------------------- API key


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (b"Bearer k", b"k"),
        (b"bearer k", b"k"),
        (b"BEARER k", b"k"),
        (b"bEaReR  k", b"k"),
        (b"Basic k", b""),
        (b"k", b""),
        (b"Bearerk", b""),
        (b"", b""),
        (b"Bearer ", b""),
    ],
)
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_auth_scheme_is_case_insensitive(tokenizer):
    from kvserve.server.app import create_app

    config = ServerConfig(stats_log_interval=0, api_key="sekrit")
    with TestClient(create_app(config, engine=FakeEngine(tokenizer))) as client:
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert (
                client.get("/v1/models", headers={"Authorization": f"{scheme} sekrit"}).status_code
                == 200
            )
        for value in ("bearer wrong", "BEARER sekri", "Basic sekrit", "sekrit", "bearer sekrit2"):
            resp = client.get("/v1/models", headers={"Authorization": value})
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", (
                value
            )
        assert client.get("/v1/models").status_code == 401


# --------------------------------------------------------------------------- the default queue bound


@pytest.mark.parametrize(
    ("max_num_seqs", "num_kv_blocks", "expected"),
    [
        (256, 2048, 512),  # the batch is the limit
        (256, 100, 200),  # the KV cache is: each running sequence holds a block at least
        (1, 10, 2),
        (4, 0, 2),
    ],
)
def test_auto_max_queue(max_num_seqs, num_kv_blocks, expected):
    from kvserve.server.serving import resolve_max_queue

    assert resolve_max_queue("auto", max_num_seqs, num_kv_blocks) == expected
    assert resolve_max_queue("off", max_num_seqs, num_kv_blocks) is None
    assert resolve_max_queue(7, max_num_seqs, num_kv_blocks) == 7


def test_max_queue_setting(monkeypatch):
    from kvserve.server.cli import build_parser, load_config

    def config(*argv: str) -> ServerConfig:
        return load_config(build_parser().parse_args(["serve", *argv]))

    assert config().max_queue == "auto"
    assert config("--max-queue", "off").max_queue == "off"
    assert config("--max-queue", "0").max_queue == 0
    monkeypatch.setenv("KVSERVE_MAX_QUEUE", "64")
    assert config().max_queue == 64
    for bad in ("-1", "none", "1.5"):
        with pytest.raises(ValueError, match="--max-queue"):
            config("--max-queue", bad)


@pytest.mark.parametrize(("setting", "num_accepted"), [("auto", 3), (5, 6), ("off", 128)])
def test_overload_gets_503(tokenizer, setting, num_accepted):
    """One seat (--max-num-seqs 1): a request for n sequences leaves n - 1 waiting. The scripted
    engine has 10 KV blocks, so `auto` lets 2 wait."""
    from kvserve.server.app import create_app

    config = ServerConfig(stats_log_interval=0, max_num_seqs=1, max_queue=setting)
    with TestClient(create_app(config, engine=FakeEngine(tokenizer))) as client:
        ok = client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": num_accepted}
        )
        assert ok.status_code == 200, ok.text
        if num_accepted < 128:
            refused = client.post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": num_accepted + 1}
            )
            assert (
                refused.status_code == 503
                and refused.json()["error"]["code"] == "server_overloaded"
            )
            assert refused.headers["retry-after"] == "1"


# --------------------------------------------------------------------------- prompt-token counters


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("robustness_llama") / "llama", "llama")


def _prompt_counters(llm) -> tuple[int, int, int]:
    s = llm.engine.stats()
    return s.prompt_tokens_total, s.prompt_tokens_cached_total, s.prompt_tokens_computed_total


def test_prompt_token_counters_with_and_without_prefix_hits(llama):
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(llama, dtype="float32", device="cpu", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = list(range(3, 21))  # 18 tokens: 4 full blocks, then 2 tokens
    llm.generate([prompt], params, use_tqdm=False)
    assert _prompt_counters(llm) == (18, 0, 18)
    llm.generate([prompt], params, use_tqdm=False)  # the 4 full blocks come from the cache
    assert _prompt_counters(llm) == (36, 16, 20)
    llm.generate(
        [list(range(30, 40))], SamplingParams(n=3, max_tokens=2, ignore_eos=True), use_tqdm=False
    )
    received, cached, computed = _prompt_counters(llm)
    assert (received, cached) == (46, 16) and computed >= 30  # one prompt for its 3 samples


def test_preempted_requests_are_received_once(llama):
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(
        llama, dtype="float32", device="cpu", block_size=4, num_kv_blocks=16
    )  # 60 tokens: preemptions
    lengths = [1, 3, 7, 17, 40]
    prompts = [list(range(3 + 50 * i, 3 + 50 * i + n)) for i, n in enumerate(lengths)]
    llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    received, cached, computed = _prompt_counters(llm)
    assert llm.engine.stats().num_preemptions_total > 0
    assert received == sum(lengths) and computed >= received - cached


def test_server_counts_received_and_cached_prompt_tokens(server):  # noqa: F811
    names = (
        "kvserve:prompt_tokens_total",
        "kvserve:prompt_tokens_cached_total",
        "kvserve:prompt_tokens_computed_total",
        "kvserve:prefix_cache_hits_total",
    )
    before = scrape(server.url)
    prompt = " ".join(uuid.uuid4().hex for _ in range(12))  # new to the prefix cache
    usages = []
    for _ in range(2):
        resp = httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True},
        )
        assert resp.status_code == 200, resp.text
        usages.append(resp.json()["usage"]["prompt_tokens"])
    after = scrape(server.url)
    received, cached, computed, hits = (metric(after, n) - metric(before, n) for n in names)
    num_prompt = usages[0]
    expected_hits = (num_prompt - 1) // 16 * 16  # the second request's full blocks (block size 16)
    assert num_prompt > 16 and received == 2 * num_prompt
    assert cached == hits == expected_hits
    assert computed == received - cached
