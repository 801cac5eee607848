"""Server pieces without a model: config and CLI, chat templates, logprob formats, and the app
against a scripted fake engine (internal errors, engine refusals, a dead engine)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kvserve.engine import SamplingParams
from kvserve.engine.generation_config import GenerationConfig
from kvserve.engine.outputs import (
    CompletionOutput,
    EngineStats,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from kvserve.server.chat import load_chat_template, render_chat
from kvserve.server.cli import build_parser, load_config, main
from kvserve.server.config import ServerConfig, parse_size
from kvserve.server.errors import APIError
from kvserve.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from kvserve.server.protocol import ChatMessage


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from checkpoints import save_tokenizer

    return save_tokenizer(tmp_path_factory.mktemp("server_tokenizer"))


# --------------------------------------------------------------------------- config and CLI


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4GiB", 4 * 1024**3),
        ("512MB", 512 * 10**6),
        ("1e9", 10**9),
        ("1048576", 1048576),
        ("1.5 KiB", 1536),
        (2048, 2048),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "4 parsecs", "-1", "0", "GiB", True])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def _config(argv: list[str]) -> ServerConfig:
    return load_config(build_parser().parse_args(["serve", *argv]))


def test_flags_win_over_env(monkeypatch):
    monkeypatch.setenv("KVSERVE_PORT", "9000")
    monkeypatch.setenv("KVSERVE_KV_CACHE_MEMORY", "1GiB")
    monkeypatch.setenv("KVSERVE_CORS_ORIGIN", "http://a.test, http://b.test")
    monkeypatch.setenv("KVSERVE_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("KVSERVE_MAX_QUEUE", "")  # empty = unset
    config = _config([])
    assert (
        config.port == 9000
        and config.kv_cache_memory == 1024**3
        and not config.enable_prefix_caching
    )
    assert config.max_queue == "auto"
    assert config.cors_origin == ["http://a.test", "http://b.test"]
    config = _config(
        [
            "--port",
            "9100",
            "--kv-cache-memory",
            "4GiB",
            "--cors-origin",
            "http://c.test",
            "--enable-prefix-caching",
            "--served-model-name",
            "a,b",
            "--served-model-name",
            "c",
        ]
    )
    assert (
        config.port == 9100
        and config.kv_cache_memory == 4 * 1024**3
        and config.enable_prefix_caching
    )
    assert config.cors_origin == ["http://c.test"] and config.served_model_name == ["a", "b", "c"]


def test_defaults_and_engine_args(monkeypatch):
    from kvserve.engine import EngineArgs

    config = _config([])
    assert (config.host, config.port, config.model, config.max_queue, config.api_key) == (
        "127.0.0.1",
        8000,
        None,
        "auto",
        [],
    )
    EngineArgs(**config.engine_kwargs()).validate()  # every engine flag maps onto EngineArgs


def test_bad_config_names_flag_and_env():
    with pytest.raises(ValueError, match="--port / KVSERVE_PORT"):
        _config(["--port", "http"])
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        _config(["--kv-cache-memory", "lots"])


def test_help_lists_every_flag_with_its_env_var(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ServerConfig.model_fields:
        assert "--" + name.replace("_", "-") in text
        assert "KVSERVE_" + name.upper() in text.replace("KVSERVE_ ", "KVSERVE_")


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("kvserve ")


def test_bench_delegates_to_loadtest(monkeypatch):
    from kvserve.loadtest import cli as loadtest_cli

    seen = []
    monkeypatch.setattr(loadtest_cli, "main", lambda argv: seen.append(argv) or 0)
    assert main(["bench", "serve", "--base-url", "http://x"]) == 0
    assert seen == [["serve", "--base-url", "http://x"]]


# --------------------------------------------------------------------------- chat templates


def test_load_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()
    assert load_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja"):
        load_chat_template("{% for %}")


def test_render_chat(tokenizer):
    messages = [
        ChatMessage(
            role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        )
    ]
    text = render_chat(tokenizer, tokenizer.chat_template, messages)
    assert text == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(APIError) as exc:
        render_chat(tokenizer, None, messages)
    assert exc.value.status_code == 400 and exc.value.code == "chat_template_missing"
    for template in (
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ raise_exception('roles!') }}",
    ):
        with pytest.raises(
            APIError
        ) as exc:  # the sandbox refuses; the client gets a 400, not a 500
            render_chat(tokenizer, template, messages)
        assert exc.value.status_code == 400


# --------------------------------------------------------------------------- logprobs


def test_completion_logprobs_legacy_format(tokenizer):
    ids = tokenizer.encode("The quick")
    entries = [
        None,
        {ids[1]: Logprob(-1.5, 2, " quick"), 7: Logprob(-0.5, 1, "x"), 9: Logprob(-3.0, 3, "y")},
    ]
    result = completion_logprobs(ids, entries, 1, TokenText(tokenizer))
    assert result.tokens == [tokenizer.decode([ids[0]]), " quick"]
    assert result.token_logprobs == [None, -1.5]
    assert result.top_logprobs == [None, {"x": -0.5, " quick": -1.5}]  # top-1 plus the chosen token
    assert result.text_offset == [0, len(result.tokens[0])]


def test_chat_logprobs_format_and_bytes(tokenizer):
    ids = tokenizer.encode("東京")  # multi-byte characters split across byte-level tokens
    token_text = TokenText(tokenizer)
    entries = [
        {i: Logprob(-float(k) if k else -math.inf, 1, None), 1: Logprob(-0.1, 2, None)}
        for k, i in enumerate(ids)
    ]
    content = chat_logprobs(ids, entries, 2, token_text)
    assert bytes(b for entry in content for b in entry.bytes).decode() == "東京"
    assert content[0].logprob == -9999.0  # -inf is not JSON
    assert [len(e.top_logprobs) for e in content] == [2] * len(ids)
    assert json.dumps([e.model_dump() for e in content])


# --------------------------------------------------------------------------- the app on a fake engine


class FakeEngine:
    """Scripted engine: yields one token per output; `mode` makes it fail in different ways."""

    def __init__(self, tokenizer, chat_template=None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_config = SimpleNamespace(
            model_path="/fake",
            dtype="float32",
            device="cpu",
            max_model_len=64,
            vocab_size=len(tokenizer),
            block_size=16,
            quantization="none",
            weight_bytes=0,
            eos_token_ids=(),
            decoder_start_token_id=None,
            generation_config=GenerationConfig(),
        )
        self.is_healthy = True
        self.mode = "ok"
        self.aborted: list[str] = []

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 10, 10, 0, 0, 0, 0, 0)

    async def generate(self, prompt, params: SamplingParams, request_id: str):
        if self.mode == "refuse":
            raise ValueError("temperature must be something else, got 1.0")
        metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=0.2)
        token_ids: list[int] = []
        for step in range(params.max_tokens):
            if self.mode == "crash" and step == 1:
                raise RuntimeError("kernel exploded")
            token_ids.append(65 + step)
            done = step == params.max_tokens - 1
            metrics.last_token_time = metrics.finished_time = 0.2 + step
            out = CompletionOutput(
                index=0,
                text=self.tokenizer.decode(token_ids),
                token_ids=list(token_ids),
                finish_reason="length" if done else None,
                delta_text=self.tokenizer.decode([token_ids[-1]]),
                delta_token_ids=[token_ids[-1]],
            )
            yield RequestOutput(
                request_id, None, list(prompt), [out], finished=done, metrics=metrics
            )

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def shutdown(self) -> None:
        pass


@pytest.fixture()
def fake(tokenizer):
    from kvserve.server.app import create_app

    engine = FakeEngine(tokenizer)
    with TestClient(create_app(ServerConfig(stats_log_interval=0), engine=engine)) as client:
        yield engine, client


def test_fake_engine_roundtrip(fake):
    engine, client = fake
    resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    assert resp.json()["model"] == "kvserve-default"
    assert client.get("/v1/models").json()["data"][0]["root"] == "/fake"


def test_internal_error_fails_only_that_request(fake):
    engine, client = fake
    engine.mode = "crash"
    resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    with client.stream(
        "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}
    ) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert s.status_code == 200
    assert (
        json.loads(events[-2][6:])["error"]["code"] == "internal_error"
        and events[-1] == "data: [DONE]"
    )
    engine.mode = "ok"
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_engine_refusal_is_a_400(fake):
    engine, client = fake
    engine.mode = "refuse"
    for stream in (False, True):
        resp = client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"


def test_chat_without_template_is_a_400(fake):
    _, client = fake
    resp = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "chat_template_missing"


def test_dead_engine_health_and_metrics(fake):
    engine, client = fake
    assert client.get("/health").status_code == 200
    engine.is_healthy = False
    resp = client.get("/health")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead"
    assert client.get("/metrics").status_code == 200


def test_chat_template_flag_overrides_the_model(tokenizer):
    from kvserve.server.app import create_app

    engine = FakeEngine(tokenizer, chat_template=tokenizer.chat_template)
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    config = ServerConfig(stats_log_interval=0, chat_template=template)
    with TestClient(create_app(config, engine=engine)) as client:
        resp = client.post(
            "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
        ).json()
        assert tokenizer.decode(resp["tokens"]) == "<<hi>>"
        chat = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == resp["count"]
