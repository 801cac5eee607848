"""`POST /v1/responses` against a real server (THINKING_TEMPLATE, hermes tool parser) with the
openai SDK unchanged: text, streamed text (raw events and the SDK's `responses.stream` helper),
function tools with a tool-result turn, `text.format` json schema, reasoning items and usage, and
the 400s for what the server cannot honour; langchain-openai with `use_responses_api=True`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_fixtures import server_checkpoint, thinking_server  # noqa: F401  (pytest fixtures)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {
        "type": "object",
        "required": ["city"],
        "additionalProperties": False,
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    },
}
SCHEMA = {
    "type": "object",
    "required": ["answer"],
    "additionalProperties": False,
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
}


@pytest.fixture(scope="module")
def client(thinking_server):  # noqa: F811
    return openai.OpenAI(base_url=thinking_server.base_url, api_key="unused", max_retries=0)


def test_text(client):
    resp = client.responses.create(
        model="tiny",
        input="Hello",
        instructions="Be brief.",
        max_output_tokens=5,
        temperature=0,
        reasoning={"effort": "low"},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in resp.output] == ["message"] and resp.output_text
    assert resp.usage.output_tokens == 5 and resp.usage.input_tokens > 0
    assert resp.usage.input_tokens_details.cached_tokens >= 0
    assert resp.usage.output_tokens_details.reasoning_tokens == 0


def test_streamed_text_equals_the_whole(client):
    kwargs = {
        "model": "tiny",
        "input": [{"role": "user", "content": "Hello"}],
        "max_output_tokens": 6,
        "temperature": 0,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert (
        kinds[:2] == ["response.created", "response.in_progress"]
        and kinds[-1] == "response.incomplete"
    )
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.output[0].content[0].text == text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_structured_output_and_the_stream_helper(client):
    fmt = {"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}}
    resp = client.responses.create(model="tiny", input="Is it?", text=fmt, max_output_tokens=120)
    assert resp.status == "completed" and json.loads(resp.output_text)["answer"] in ("yes", "no")
    with client.responses.stream(
        model="tiny", input="Is it?", text=fmt, max_output_tokens=120
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and json.loads(final.output_text)["answer"] in (
        "yes",
        "no",
    )


def test_function_call_and_tool_result_turn(client):
    resp = client.responses.create(
        model="tiny",
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=120,
    )
    calls = [item for item in resp.output if item.type == "function_call"]
    assert (
        calls
        and calls[0].name == "get_weather"
        and json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    )
    assert calls[0].call_id.startswith("call_")
    events = list(
        client.responses.create(
            model="tiny",
            input="Weather in Paris?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=120,
            stream=True,
        )
    )
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(arguments) == json.loads(done.arguments) and done.name == "get_weather"
    follow_up = client.responses.create(
        model="tiny",
        tools=[WEATHER],
        max_output_tokens=4,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": calls[0].name,
                "arguments": calls[0].arguments,
            },
            {
                "type": "function_call_output",
                "call_id": calls[0].call_id,
                "output": '{"temp_c": 21}',
            },
        ],
    )
    assert (
        follow_up.usage.input_tokens > resp.usage.input_tokens
    )  # the call and its result were rendered
    assert follow_up.output


def test_reasoning_item(client):
    # a prompt that opens the think block: the (cut off) output is all reasoning
    resp = client.responses.create(
        model="tiny",
        input="Think.",
        max_output_tokens=4,
        extra_body={"chat_template_kwargs": {"open_think": True}},
    )
    assert [item.type for item in resp.output] == ["reasoning"]
    assert resp.output[0].content[0].text and resp.usage.output_tokens_details.reasoning_tokens == 4
    events = list(
        client.responses.create(
            stream=True,
            model="tiny",
            input="Think.",
            max_output_tokens=4,
            extra_body={"chat_template_kwargs": {"open_think": True}},
        )
    )
    assert "response.reasoning_text.delta" in [e.type for e in events]
    assert events[-1].response.output[0].type == "reasoning"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content",
        ),
        ({"input": []}, "input"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        (
            {"input": "hi", "max_output_tokens": 100000},
            "input",
        ),  # context_length_exceeded, as chat names messages
        ({"input": "hi", "temperature": "hot"}, "temperature"),
        ({"input": "hi", "priority": 3}, "priority"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": 5}, "input"),
    ],
)
def test_bad_input_is_a_400(thinking_server, body, param):  # noqa: F811
    resp = httpx.post(thinking_server.base_url + "/responses", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "Traceback" not in resp.text


def test_langchain_responses_api(thinking_server):  # noqa: F811
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model="tiny",
        base_url=thinking_server.base_url,
        api_key="unused",
        use_responses_api=True,
        max_tokens=4,
        max_retries=0,
    )
    message = llm.invoke("Hello")
    assert message.content and message.usage_metadata["output_tokens"] == 4
