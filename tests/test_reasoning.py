"""Reasoning parsers (server/reasoning.py) and `reasoning_content` in chat.

- the parsers on strings, fed whole and piece by piece (a stream always equals the whole response);
- auto-detection from chat templates;
- a real server on the tiny checkpoint with a Qwen3-style template (THINKING_TEMPLATE): the output is
  steered into `<think>...</think>answer` with guided_regex, so even a random model thinks; streamed
  deltas equal the whole message; `enable_thinking: false` and `reasoning_effort` reach the template;
  a prompt that opens the think block makes the whole (cut off) output reasoning.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvserve.server.reasoning import (
    REASONING_PARSERS,
    ReasoningStreamer,
    detect_reasoning_parser,
    num_reasoning_tokens,
    split_reasoning,
)
from server_fixtures import server_checkpoint, thinking_server  # noqa: F401  (pytest fixtures)

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
THINK_REGEX = r"<think>[a-z]{2,8}( [a-z]{2,8}){0,2}</think>\n\n[a-z]{2,8}"
MSG = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.mark.parametrize(
    ("parser", "state", "text", "expected"),
    [
        (QWEN3, "open", "<think>\nhmm, ok</think>\n\nThe answer", ("hmm, ok", "The answer", True)),
        (QWEN3, "open", "Just an answer", (None, "Just an answer", False)),
        (
            QWEN3,
            "open",
            "  <thi",
            (None, "  <thi", False),
        ),  # a cut-off marker that never became one
        (QWEN3, "open", "", (None, "", False)),
        (R1, "reasoning", "hmm</think>\n\nans", ("hmm", "ans", True)),
        (
            R1,
            "reasoning",
            "<think>hmm</think>ans",
            ("hmm", "ans", True),
        ),  # the model repeats the prompt's marker
        (
            R1,
            "reasoning",
            "cut off </thi",
            ("cut off </thi", "", False),
        ),  # thinking cut off by max_tokens
    ],
)
def test_split_whole_and_streamed(parser, state, text, expected):
    assert split_reasoning(parser, state, text) == expected
    for size in (1, 2, 5):
        streamer, reasoning, answer = ReasoningStreamer(parser, state), "", ""
        for i in range(0, len(text), size):
            r, a = streamer.feed(text[i : i + size])
            reasoning, answer = reasoning + r, answer + a
        r, a = streamer.finish()
        assert ((reasoning + r) if streamer.has_reasoning else None, answer + a) == expected[:2]


def test_where_the_output_starts():
    assert QWEN3.initial_state("<|im_start|>assistant\n") == "open"
    assert QWEN3.initial_state("<|im_start|>assistant\n<think>\n") == "reasoning"
    assert (
        QWEN3.initial_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "open"
    )  # thinking off
    assert R1.initial_state("<｜Assistant｜>") == "reasoning"
    assert R1.initial_state("<｜Assistant｜><think>\n") == "reasoning"
    assert R1.initial_state("<｜Assistant｜><think>\n", is_constrained=True) == "open"


def test_detect_from_template():
    assert (
        detect_reasoning_parser(
            "{{ '<|im_start|>' }}{% if enable_thinking %}<think></think>{% endif %}"
        )
        == "qwen3"
    )
    assert (
        detect_reasoning_parser("<｜Assistant｜><think>\n{{ x.split('</think>')[-1] }}")
        == "deepseek_r1"
    )
    assert detect_reasoning_parser("[INST] {{ m }} [/INST]") is None
    assert detect_reasoning_parser("something </think> of an unknown family") is None
    assert detect_reasoning_parser(None) is None


def test_num_reasoning_tokens():
    pieces = ["<think>", "a", "b", "</th", "ink>", "x"]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert num_reasoning_tokens(list(range(6)), decode, "</think>", is_ended=True) == 5
    assert num_reasoning_tokens(list(range(3)), decode, "</think>", is_ended=False) == 3


# ----------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def client(thinking_server):  # noqa: F811
    return openai.OpenAI(base_url=thinking_server.base_url, api_key="unused", max_retries=0)


def test_reasoning_content_split(client):
    resp = client.chat.completions.create(
        model="tiny",
        messages=MSG,
        max_tokens=40,
        temperature=0,
        extra_body={"guided_regex": THINK_REGEX},
    )
    message = resp.choices[0].message
    raw = message.model_extra["reasoning_content"]
    assert raw and "<think>" not in raw and "</think>" not in raw
    assert message.content and "<" not in message.content
    assert 0 < resp.usage.completion_tokens_details.reasoning_tokens < resp.usage.completion_tokens

    stream = client.chat.completions.create(
        model="tiny",
        messages=MSG,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"guided_regex": THINK_REGEX},
    )
    reasoning, content, usage = "", "", None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (raw, message.content)  # greedy: the same output
    assert (
        usage.completion_tokens_details.reasoning_tokens
        == resp.usage.completion_tokens_details.reasoning_tokens
    )


def test_thinking_off_and_open(client):
    off = client.chat.completions.create(
        model="tiny",
        messages=MSG,
        max_tokens=6,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.choices[0].message.model_extra.get("reasoning_content") is None
    assert off.choices[0].message.content
    opened = client.chat.completions.create(
        model="tiny",
        messages=MSG,
        max_tokens=6,
        extra_body={"chat_template_kwargs": {"open_think": True}},
    )
    message = opened.choices[0].message
    assert (
        message.model_extra["reasoning_content"] and message.content is None
    )  # cut off while thinking
    assert opened.usage.completion_tokens_details.reasoning_tokens == opened.usage.completion_tokens


def test_reasoning_effort_reaches_the_template(client):
    def prompt_tokens(**kw):
        return client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=1, **kw
        ).usage.prompt_tokens

    assert prompt_tokens(reasoning_effort="low") > prompt_tokens()
    resp = httpx.post(
        str(client.base_url) + "chat/completions",
        timeout=30,
        json={"messages": MSG, "max_tokens": 1, "reasoning_effort": "extreme"},
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "reasoning_effort"


def test_tools_are_parsed_from_the_answer_only(client):
    # a call written inside the thinking is not a call; the hermes parser reads the answer
    regex = r'<think><tool_call>\{"name": "f", "arguments": \{\}\}</tool_call></think>\n\nok'
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    resp = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=150, tools=tools, extra_body={"guided_regex": regex}
    )
    message = resp.choices[0].message
    assert message.tool_calls is None and message.content == "ok"
    assert json.loads(
        message.model_extra["reasoning_content"]
        .removeprefix("<tool_call>")
        .removesuffix("</tool_call>")
    ) == {"name": "f", "arguments": {}}
