"""Big inputs: tokenization and chat rendering off the event loop, prompts that
cannot fit refused before tokenizing, bounded message counts and stop strings.

The app tests run in-process on one event loop (httpx's ASGI transport) with a fake engine
and a tokenizer that records which thread does its work; a big request's encode blocks until
a heartbeat task on the loop has ticked and /health has answered, which can only happen when
the encode runs off the loop. Nothing here measures time.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from kvserve.engine import SamplingParams
from kvserve.engine.generation_config import GenerationConfig
from kvserve.engine.input_processor import (
    INLINE_MAX_CHARS,
    PromptTooLongError,
    check_prompt_chars,
    max_chars_per_token,
    process_prompt,
)
from kvserve.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from kvserve.engine.sampling_params import MAX_NUM_STOP, MAX_NUM_STOP_TOKEN_IDS, MAX_STOP_CHARS
from kvserve.server.config import ServerConfig
from server_fixtures import server, server_checkpoint  # noqa: F401  (pytest fixtures)

MAX_MODEL_LEN = 64
BIG = INLINE_MAX_CHARS + 1  # characters: above this, work goes to the tokenizer threads


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from checkpoints import save_tokenizer

    return save_tokenizer(tmp_path_factory.mktemp("big_inputs_tokenizer"))


# --------------------------------------------------------------------------- the character bound


def test_max_chars_per_token_is_the_longest_entry_of_a_byte_level_bpe(tokenizer):
    longest = max(len(t) for t in tokenizer.get_vocab())
    assert max_chars_per_token(tokenizer) == longest


def test_max_chars_per_token_bounds_real_tokenization(tokenizer):
    """No text tokenizes to fewer than len(text) / bound tokens (what makes the early 400 safe)."""
    from checkpoints import CORPUS

    bound = max_chars_per_token(tokenizer)
    texts = CORPUS + [
        "".join(CORPUS) * 3,
        " " * 500,
        "\u00e9" * 300,
        "e\u0301" * 300,
        "\U0001f680" * 100,
        "<|im_start|>" * 40,
        "aaaa" * 300,
    ]
    for text in texts:
        assert len(text) <= bound * len(tokenizer.encode(text, add_special_tokens=False)), text[:40]


def _bpe(normalizer=None, pre_tokenizer=None, model=None) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(
        model
        or models.BPE(
            vocab={"a": 0, "b": 1, "ab": 2, "<unk>": 3},
            merges=[("a", "b")],
            unk_token="<unk>",
            byte_fallback=True,
        )
    )
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def test_max_chars_per_token_only_where_it_is_safe():
    llama2 = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    assert max_chars_per_token(_bpe(llama2)) == 5  # "<unk>"
    llama3 = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", "isolated"), pre_tokenizers.ByteLevel(use_regex=False)]
    )
    assert max_chars_per_token(_bpe(pre_tokenizer=llama3)) == 5
    assert (
        max_chars_per_token(_bpe(normalizers.NFC())) == 5 * 4
    )  # composition folds up to 4 code points
    # parts that can drop characters (or fold many into one token) leave no safe bound
    assert max_chars_per_token(_bpe(normalizers.StripAccents())) is None
    assert max_chars_per_token(_bpe(normalizers.Replace(" ", ""))) is None
    assert max_chars_per_token(_bpe(pre_tokenizer=pre_tokenizers.Whitespace())) is None
    assert max_chars_per_token(_bpe(pre_tokenizer=pre_tokenizers.Split(" ", "removed"))) is None
    assert (
        max_chars_per_token(
            _bpe(model=models.WordPiece(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        )
        is None
    )
    fused = models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", fuse_unk=True)
    assert max_chars_per_token(_bpe(model=fused)) is None


def test_check_prompt_chars_quotes_the_numbers():
    check_prompt_chars(640, 0, 64, 10)  # 64 tokens at least: fits exactly
    with pytest.raises(
        PromptTooLongError, match=r"641 characters, which is at least 65 tokens"
    ) as exc:
        check_prompt_chars(641, 0, 64, 10)
    assert "maximum context length is 64 tokens" in str(exc.value) and isinstance(
        exc.value, ValueError
    )
    with pytest.raises(PromptTooLongError, match="you requested 5 tokens"):
        check_prompt_chars(600, 5, 64, 10)
    check_prompt_chars(10**9, 5, 64, None)  # no bound known: tokenize and see


class SpyTokenizer:
    """The real tokenizer, recording the thread of each encode / decode / template render;
    `gate` (if set) is waited on inside every call with a big input."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.calls: list[tuple[str, str]] = []  # (method, thread name)
        self.gate: threading.Event | None = None
        self.gate_was_open: list[bool] = []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self) -> int:
        return len(self._tok)

    def _record(self, method: str, size: int) -> None:
        self.calls.append((method, threading.current_thread().name))
        if self.gate is not None and size > INLINE_MAX_CHARS:
            self.gate_was_open.append(self.gate.wait(timeout=10))

    def encode(self, text, **kwargs):
        self._record("encode", len(text))
        return self._tok.encode(text, **kwargs)

    def decode(self, ids, **kwargs):
        self._record("decode", 4 * len(ids))
        return self._tok.decode(ids, **kwargs)

    def apply_chat_template(self, conversation, **kwargs):
        self._record("render", sum(len(m["content"]) for m in conversation))
        return self._tok.apply_chat_template(conversation, **kwargs)


def test_process_prompt_refuses_before_tokenizing(tokenizer):
    spy = SpyTokenizer(tokenizer)
    info = SimpleNamespace(
        max_model_len=MAX_MODEL_LEN,
        vocab_size=len(tokenizer),
        kv_capacity_tokens=1024,
        is_encoder_decoder=False,
        task="generate",
    )
    bound = max_chars_per_token(tokenizer)
    with pytest.raises(ValueError, match="context length"):
        process_prompt(
            spy, info, "x" * (MAX_MODEL_LEN * bound), SamplingParams(max_tokens=1), bound
        )
    assert spy.calls == []
    assert process_prompt(spy, info, "hello", SamplingParams(max_tokens=4), bound).max_tokens == 4


# --------------------------------------------------------------------------- stop-string bounds


def test_sampling_params_bounds_stop_strings():
    SamplingParams(stop=["x" * (MAX_STOP_CHARS // MAX_NUM_STOP)] * MAX_NUM_STOP)
    with pytest.raises(
        ValueError, match=rf"at most {MAX_NUM_STOP} strings.*got {MAX_NUM_STOP + 1} strings"
    ):
        SamplingParams(stop=["x"] * (MAX_NUM_STOP + 1))
    with pytest.raises(ValueError, match=rf"got 2 strings of {MAX_STOP_CHARS + 1} characters"):
        SamplingParams(stop=["a" * MAX_STOP_CHARS, "b"])
    params = SamplingParams(stop=["ok"])
    params.stop = ["y" * 10_000]  # a mutated object is caught by validate() too
    with pytest.raises(ValueError, match="stop"):
        params.validate()
    with pytest.raises(
        ValueError, match=rf"stop_token_ids accepts at most {MAX_NUM_STOP_TOKEN_IDS}"
    ):
        SamplingParams(stop_token_ids=list(range(MAX_NUM_STOP_TOKEN_IDS + 1)))


# --------------------------------------------------------------------------- the app, in-process


class FakeEngine:
    """Answers every request with one token; `tokenizer` is the spy."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.model_config = SimpleNamespace(
            model_path="/fake",
            dtype="float32",
            device="cpu",
            max_model_len=max_model_len,
            vocab_size=len(tokenizer),
            block_size=16,
            quantization="none",
            weight_bytes=0,
            eos_token_ids=(),
            decoder_start_token_id=None,
            generation_config=GenerationConfig(),
        )
        self.is_healthy = True
        self.num_generated = 0

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 1000, 1000, 0, 0, 0, 0, 0)

    async def generate(self, prompt, params: SamplingParams, request_id: str):
        self.num_generated += 1
        out = CompletionOutput(
            index=0,
            text="A",
            token_ids=[65],
            finish_reason="length",
            delta_text="A",
            delta_token_ids=[65],
        )
        yield RequestOutput(
            request_id,
            None,
            list(prompt),
            [out],
            finished=True,
            metrics=RequestMetrics(arrival_time=0.0, first_token_time=0.1, finished_time=0.1),
        )

    async def abort(self, request_id: str) -> None:
        pass

    async def shutdown(self) -> None:
        pass


async def _with_app(tokenizer, coro_fn, max_model_len: int = MAX_MODEL_LEN, **config):
    from kvserve.server.app import create_app

    spy = SpyTokenizer(tokenizer)
    engine = FakeEngine(spy, max_model_len)
    app = create_app(ServerConfig(stats_log_interval=0, **config), engine=engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", timeout=60
        ) as client:
            return await coro_fn(client, spy, engine)


async def _while_heartbeat(client, spy, request):
    """Run `request` while a heartbeat ticks on the loop and /health is asked; the tokenizer's
    big calls wait until both happened. Returns (response, ticks, gate_was_open)."""
    spy.gate = threading.Event()
    ticks = 0

    async def heartbeat():
        nonlocal ticks
        while not spy.gate.is_set():
            await asyncio.sleep(0)
            ticks += 1
            if ticks == 100:
                assert (await client.get("/health")).status_code == 200
                spy.gate.set()

    beat = asyncio.ensure_future(heartbeat())
    resp = await request
    spy.gate.set()
    await beat
    return resp, ticks, spy.gate_was_open


def _threads(spy, method):
    return [thread for name, thread in spy.calls if name == method]


@pytest.mark.parametrize(
    "endpoint", ["completions", "chat", "tokenize", "tokenize_chat", "detokenize"]
)
def test_big_input_work_runs_off_the_event_loop(tokenizer, endpoint):
    """A big request's tokenize/render does not stop the loop: /health and a heartbeat task
    run while it is in progress (before the fix, the encode ran on the loop and its gate,
    waiting for them, timed out)."""
    text = "The quick brown fox. " * (
        BIG // 21 + 1
    )  # ~1,000 tokens, within the 4,096 of this context
    bodies = {
        "completions": ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        "chat": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": text}], "max_tokens": 1},
        ),
        "tokenize": ("/tokenize", {"prompt": text}),
        "tokenize_chat": ("/tokenize", {"messages": [{"role": "user", "content": text}]}),
        "detokenize": ("/detokenize", {"tokens": [65] * BIG}),
    }
    path, body = bodies[endpoint]

    async def run(client, spy, engine):
        resp, ticks, gate_was_open = await _while_heartbeat(
            client, spy, client.post(path, json=body)
        )
        return resp, ticks, gate_was_open, list(spy.calls)

    resp, ticks, gate_was_open, calls = asyncio.run(_with_app(tokenizer, run, max_model_len=4096))
    assert resp.status_code == 200, resp.text
    assert gate_was_open and all(gate_was_open), "the big call ran before /health could answer"
    assert ticks >= 100
    assert calls and all(thread.startswith("kvserve-tokenize") for _, thread in calls), calls


def test_small_inputs_stay_inline(tokenizer):
    async def run(client, spy, engine):
        resp = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
        assert resp.status_code == 200
        return _threads(spy, "encode")

    assert asyncio.run(_with_app(tokenizer, run)) == ["MainThread"]


def test_prompt_that_cannot_fit_is_refused_before_tokenizing(tokenizer):
    bound = max_chars_per_token(tokenizer)

    async def run(client, spy, engine):
        results = {}
        at_least_63_tokens = MAX_MODEL_LEN * bound - bound  # + 1 completion token: may fit
        for name, size, max_tokens in (
            ("exact", at_least_63_tokens, 1),
            ("over", at_least_63_tokens + 1, 1),
            ("with_completion", at_least_63_tokens, 10),
        ):
            spy.calls.clear()
            resp = await client.post(
                "/v1/completions", json={"prompt": "x" * size, "max_tokens": max_tokens}
            )
            results[name] = (resp.status_code, resp.json(), _threads(spy, "encode"))
        spy.calls.clear()
        chat = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "y" * (MAX_MODEL_LEN * bound)}]},
        )
        results["chat"] = (chat.status_code, chat.json(), _threads(spy, "encode"))
        return results

    results = asyncio.run(_with_app(tokenizer, run))
    # short enough to maybe fit: tokenized, then refused with the same error after counting tokens
    status, body, encodes = results["exact"]
    assert (
        status == 400 and body["error"]["code"] == "context_length_exceeded" and len(encodes) == 1
    )
    for name in ("over", "with_completion", "chat"):
        status, body, encodes = results[name]
        assert status == 400 and encodes == [], (name, body)
        assert body["error"]["code"] == "context_length_exceeded"
        assert body["error"]["param"] == ("messages" if name == "chat" else "prompt")
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in body["error"]["message"]
        assert f"no token covers more than {bound} characters" in body["error"]["message"]


def test_max_chat_messages(tokenizer):
    def messages(n):
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(n)]

    async def run(client, spy, engine):
        ok = await client.post(
            "/v1/chat/completions", json={"messages": messages(3), "max_tokens": 1}
        )
        too_many = await client.post(
            "/v1/chat/completions", json={"messages": messages(4), "max_tokens": 1}
        )
        renders_before = len(_threads(spy, "render"))
        parts = [{"type": "text", "text": "a"}] * 4
        too_many_parts = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": parts}], "max_tokens": 1},
        )
        tokenize = await client.post("/tokenize", json={"messages": messages(4)})
        return ok, too_many, too_many_parts, tokenize, renders_before, len(_threads(spy, "render"))

    ok, too_many, too_many_parts, tokenize, renders_before, renders_after = asyncio.run(
        _with_app(tokenizer, run, max_chat_messages=3)
    )
    assert ok.status_code == 200
    for resp, what in (
        (too_many, "4 messages"),
        (too_many_parts, "4 content parts"),
        (tokenize, "4 messages"),
    ):
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (
            error["param"] == "messages"
            and what in error["message"]
            and "--max-chat-messages" in error["message"]
        )
    assert renders_before == renders_after == 1  # refused ones were never rendered


def test_max_chat_messages_default_and_flag():
    assert ServerConfig().max_chat_messages == 4096
    assert ServerConfig(max_chat_messages=10).max_chat_messages == 10
    with pytest.raises(ValueError):
        ServerConfig(max_chat_messages=0)


def test_stop_bounds_are_a_400(tokenizer):
    async def run(client, spy, engine):
        long_stop = await client.post(
            "/v1/completions", json={"prompt": "hi", "stop": ["z" * (MAX_STOP_CHARS + 1)]}
        )
        ids = await client.post(
            "/v1/completions",
            json={"prompt": "hi", "stop_token_ids": [1] * (MAX_NUM_STOP_TOKEN_IDS + 1)},
        )
        return long_stop, ids, engine.num_generated

    long_stop, ids, num_generated = asyncio.run(_with_app(tokenizer, run))
    assert long_stop.status_code == 400 and long_stop.json()["error"]["param"] == "stop"
    assert f"{MAX_STOP_CHARS + 1} characters" in long_stop.json()["error"]["message"]
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "stop_token_ids"
    assert num_generated == 0


# --------------------------------------------------------------------------- a real server


def test_real_server_refuses_an_oversized_prompt_early(server):
    """The shared server's model has a 1024-token context and a byte-level BPE tokenizer."""
    info = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    prompt = "word " * (info["max_model_len"] * 40)  # far past any bound for this vocabulary
    resp = httpx.post(
        server.base_url + "/completions", json={"model": "tiny", "prompt": prompt}, timeout=60
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in resp.json()["error"]["message"]  # found before tokenizing
    resp = httpx.post(
        server.base_url + "/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "stop": ["a" * 3000, "b" * 3000]},
        timeout=60,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# --------------------------------------------------------------------------- AsyncLLM.generate


def _bare_async_llm(tokenizer, max_model_len: int):
    """An AsyncLLM without a core process: enough state for generate() up to its first send."""
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.engine.errors import EngineDeadError

    llm = AsyncLLM.__new__(AsyncLLM)
    llm.tokenizer = tokenizer
    llm.info = SimpleNamespace(
        max_model_len=max_model_len,
        vocab_size=len(tokenizer),
        kv_capacity_tokens=10**6,
        is_encoder_decoder=False,
        task="generate",
    )
    llm._max_chars_per_token = max_chars_per_token(tokenizer)
    llm._streams, llm._error, llm._is_ready, llm._is_stopping = {}, None, True, False
    llm._process = SimpleNamespace(is_alive=lambda: True)
    llm.sent = []

    def send(message):
        llm.sent.append(type(message).__struct_config__.tag)
        raise EngineDeadError("no core in this test")

    llm._send = send
    return llm, EngineDeadError


def test_async_llm_tokenizes_big_prompts_off_the_loop(tokenizer):
    spy = SpyTokenizer(tokenizer)
    llm, engine_dead = _bare_async_llm(spy, max_model_len=4096)

    async def run(prompt, request_id):
        with pytest.raises((engine_dead, ValueError)) as exc:
            async for _ in llm.generate(prompt, SamplingParams(max_tokens=1), request_id):
                pass
        return exc.type

    assert asyncio.run(run("hello " * (BIG // 6 + 1), "big")) is engine_dead  # it reached the send
    assert asyncio.run(run("hello", "small")) is engine_dead
    threads = _threads(spy, "encode")
    assert threads[0].startswith("kvserve-tokenize") and threads[1] == "MainThread"
    spy.calls.clear()
    too_long = "x" * (4096 * max_chars_per_token(tokenizer) + 1)
    assert asyncio.run(run(too_long, "too-long")) is PromptTooLongError
    assert spy.calls == [] and llm._streams == {}
