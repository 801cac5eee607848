"""Structured outputs and logit_bias over HTTP, through the official `openai` client
against a real server on the tiny random checkpoint.

The model emits noise when left alone, so every valid output here is the grammar's doing;
sampling is at temperature 1 with a few seeds. Bad input must get a 400 in OpenAI's shape
naming the field, and leave no KV block behind.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Literal

import jsonschema
import openai
import pytest
import transformers
from pydantic import BaseModel, Field

from kvserve.server.logprobs import _byte_level_decoder
from server_fixtures import metric, scrape, server, server_checkpoint, wait_idle  # noqa: F401  (pytest fixtures)

pytest.importorskip("xgrammar")

SEEDS = (0, 1, 2)
MAX_TOKENS = 200
MSG = [{"role": "user", "content": "Describe a pet as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "minItems": 1, "maxItems": 3},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["id", "tags"],
}


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=20)


class Owner(BaseModel):
    is_happy: bool
    pets: list[Pet] = Field(min_length=1, max_length=2)


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(server_checkpoint):  # noqa: F811
    return transformers.AutoTokenizer.from_pretrained(server_checkpoint)


def _json_schema(schema: dict, strict: bool = True) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": strict},
    }


def test_parse_into_a_pydantic_model(client):
    for seed in SEEDS:
        completion = client.chat.completions.parse(
            model="tiny",
            messages=MSG,
            response_format=Owner,
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Owner), choice.message.content


def test_langchain_with_structured_output(server):  # noqa: F811
    langchain_openai = pytest.importorskip("langchain_openai")

    llm = langchain_openai.ChatOpenAI(
        base_url=server.base_url,
        api_key="unused",
        model="tiny",
        max_retries=0,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=SEEDS[0],
    )
    owner = llm.with_structured_output(Owner).invoke("Tell me about an owner and their pets.")
    assert isinstance(owner, Owner) and 1 <= len(owner.pets) <= 2


def test_json_schema_strict_and_not_validates(client):
    outputs = set()
    for seed in SEEDS:
        for strict in (True, False):  # decoding is constrained either way
            completion = client.chat.completions.create(
                model="tiny",
                messages=MSG,
                temperature=1.0,
                seed=seed,
                max_tokens=MAX_TOKENS,
                response_format=_json_schema(SCHEMA, strict),
            )
            text = completion.choices[0].message.content
            assert completion.choices[0].finish_reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMA)
            outputs.add(text)
    assert len(outputs) > 1, "seeds should give different outputs"


def test_json_object_on_chat_and_completions(client, tokenizer):
    # any JSON object: a random model nests and rambles, so a bias pushes it to close strings and objects
    closers = {str(tokenizer.convert_tokens_to_ids(t)): 8 for t in ('"', "}")}
    for seed in SEEDS:
        chat = client.chat.completions.create(
            model="tiny",
            messages=MSG,
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
            logit_bias=closers,
            response_format={"type": "json_object"},
        )
        assert isinstance(json.loads(chat.choices[0].message.content), dict), chat.choices[
            0
        ].message.content
        text = (
            client.completions.create(
                model="tiny",
                prompt="JSON: ",
                temperature=1.0,
                seed=seed,
                max_tokens=MAX_TOKENS,
                logit_bias=closers,
                extra_body={"response_format": {"type": "json_object"}},
            )
            .choices[0]
            .text
        )
        assert isinstance(json.loads(text), dict), text
        any_json = {
            "type": "json_schema",
            "json_schema": {"name": "anything"},
        }  # no schema: any JSON value
        text = (
            client.chat.completions.create(
                model="tiny",
                messages=MSG,
                temperature=1.0,
                seed=seed,
                max_tokens=MAX_TOKENS,
                logit_bias=closers,
                response_format=any_json,
            )
            .choices[0]
            .message.content
        )
        json.loads(text)


def test_completions_json_schema_and_vllm_extras(client):
    body = client.completions.create(
        model="tiny",
        prompt="JSON: ",
        temperature=1.0,
        seed=3,
        max_tokens=MAX_TOKENS,
        extra_body={"response_format": _json_schema(SCHEMA)},
    )
    jsonschema.validate(json.loads(body.choices[0].text), SCHEMA)
    email, parens = r"[a-z]{2,5}@[a-z]{2,4}\.com", r"\([0-9](\+[0-9])*\)"
    extras = [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": email}, lambda t: re.fullmatch(email, t)),
        (
            {"guided_grammar": 'root ::= "(" [0-9] ("+" [0-9])* ")"'},
            lambda t: re.fullmatch(parens, t),
        ),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ]
    for extra, check in extras:
        choices = client.completions.create(
            model="tiny",
            prompt="Answer: ",
            temperature=1.0,
            seed=1,
            n=2,
            max_tokens=60,
            extra_body=extra,
        ).choices
        assert len(choices) == 2
        for choice in choices:
            assert choice.finish_reason == "stop" and check(choice.text), (extra, choice.text)


def test_streamed_chunks_concatenate_to_valid_json(client):
    for seed in SEEDS[:2]:
        stream = client.chat.completions.create(
            model="tiny",
            messages=MSG,
            temperature=1.0,
            seed=seed,
            stream=True,
            max_tokens=MAX_TOKENS,
            response_format=_json_schema(SCHEMA),
        )
        parts, reasons = [], []
        for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                reasons.append(choice.finish_reason)
        assert len([p for p in parts if p]) > 1 and reasons[-1] == "stop"
        jsonschema.validate(json.loads("".join(parts)), SCHEMA)


def _token_ids(content, tokenizer) -> list[int]:
    """Token ids of chat logprobs entries, from their bytes (the tokenizer is byte-level BPE)."""
    byte_of = _byte_level_decoder()
    id_of = {
        bytes(byte_of[c] for c in token): i
        for token, i in tokenizer.get_vocab().items()
        if all(c in byte_of for c in token)
    }
    return [id_of[bytes(entry.bytes)] for entry in content]


def test_logit_bias_removes_and_forces_a_token(client, tokenizer):
    def greedy(bias: dict[str, float] | None) -> tuple[str, list[int]]:
        chat = client.chat.completions.create(
            model="tiny",
            messages=MSG,
            temperature=0.0,
            max_tokens=6,
            logprobs=True,
            logit_bias=bias,
        )
        choice = chat.choices[0]
        return choice.message.content, _token_ids(choice.logprobs.content, tokenizer)

    _, plain_ids = greedy(None)
    assert plain_ids
    _, banned_ids = greedy({str(plain_ids[0]): -100})
    assert plain_ids[0] not in banned_ids and banned_ids[0] != plain_ids[0]
    forced = next(i for i in range(100, 384) if i not in plain_ids)  # +100 is what puts it there
    text, forced_ids = greedy({str(forced): 100})
    assert forced_ids == [forced] * 6 and text == tokenizer.decode([forced]) * 6


BAD = [  # (case, endpoint, extra body, param, text the message must hold)
    (
        "schema-keyword-not",
        "chat",
        {"response_format": _json_schema({"not": {"type": "string"}})},
        "response_format",
        "'not'",
    ),
    (
        "schema-keyword-nested",
        "chat",
        {
            "response_format": _json_schema(
                {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
            )
        },
        "response_format",
        "'uniqueItems' at #/properties/a",
    ),
    (
        "schema-unknown-type",
        "chat",
        {"response_format": _json_schema({"type": "foo"})},
        "response_format",
        "foo",
    ),
    (
        "schema-not-object",
        "completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "[1]"}}},
        "response_format.json_schema.schema",
        None,
    ),
    (
        "json-schema-missing",
        "chat",
        {"response_format": {"type": "json_schema"}},
        "response_format.json_schema",
        None,
    ),
    (
        "format-type-unknown",
        "chat",
        {"response_format": {"type": "xml"}},
        "response_format",
        "'json_object'",
    ),
    (
        "regex-does-not-compile",
        "completions",
        {"guided_regex": "[a-"},
        "guided_regex",
        "guided_regex",
    ),
    (
        "two-constraints",
        "chat",
        {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
        "guided_choice",
        "at most one",
    ),
    (
        "structured-outputs-unknown-key",
        "completions",
        {"structured_outputs": {"jsn": {}}},
        "structured_outputs",
        "jsn",
    ),
    ("choice-empty", "completions", {"guided_choice": []}, "guided_choice", "non-empty"),
    ("bias-key-not-integer", "chat", {"logit_bias": {"fox": 1}}, "logit_bias", "'fox'"),
    ("bias-key-negative", "completions", {"logit_bias": {"-1": 1}}, "logit_bias", "'-1'"),
    ("bias-id-out-of-vocab", "chat", {"logit_bias": {"384": 1}}, "logit_bias", "384"),
    (
        "bias-id-huge",
        "completions",
        {"logit_bias": {"9" * 40: 1}},
        "logit_bias",
        "outside the vocabulary",
    ),
    ("bias-above-100", "chat", {"logit_bias": {"5": 100.5}}, "logit_bias", "100.5"),
    ("bias-below-minus-100", "completions", {"logit_bias": {"5": -101}}, "logit_bias", "-101"),
    ("bias-not-a-number", "chat", {"logit_bias": {"5": "x"}}, "logit_bias.5", None),
]


@pytest.mark.parametrize(
    ("endpoint", "extra", "param", "text"), [c[1:] for c in BAD], ids=[c[0] for c in BAD]
)
@pytest.mark.parametrize("is_stream", [False, True], ids=["json", "stream"])
def test_bad_input_is_a_400_in_openai_shape(
    client, server, endpoint, extra, param, text, is_stream
):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(
                model="tiny", messages=MSG, max_tokens=8, stream=is_stream, extra_body=extra
            )
        else:
            client.completions.create(
                model="tiny", prompt="hi", max_tokens=8, stream=is_stream, extra_body=extra
            )
    error = info.value.body
    assert info.value.status_code == 400
    assert (
        set(error) == {"message", "type", "param", "code"}
        and error["type"] == "invalid_request_error"
    )
    assert error["param"] == param, error
    assert text is None or text in error["message"], error
    wait_idle(server.url)  # nothing left running, no KV block held


def test_metrics_count_structured_requests_and_compiles(client, server):  # noqa: F811
    before = scrape(server.url)
    schema = {
        "type": "object",
        "properties": {"k": {"enum": [uuid.uuid4().hex]}},
        "required": ["k"],
    }  # a new grammar
    for _ in range(2):  # the second one hits the grammar cache
        client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=60, response_format=_json_schema(schema)
        )
    after = scrape(server.url)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta("kvserve:structured_output_requests_total") == 2
    assert delta("kvserve:grammar_compile_seconds_count") == 1
    assert delta("kvserve:grammar_compile_seconds_sum") > 0
    assert metric(after, "kvserve:num_requests_compiling") == 0
