"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, the parsers and their streaming.

- the parsers (hermes, llama3_json, mistral) on strings, and `ToolStreamer` fed piece by piece;
- the app on a scripted engine whose output is a tool call in each format (tool_choice auto):
  non-streamed `message.tool_calls` and the streamed `delta.tool_calls` agree;
- a real server on the tiny random checkpoint with a Hermes-style chat template that renders
  tools: `required` and a named function are enforced by a grammar, so even a random model
  makes valid calls; `auto` on a server per parser (hermes, llama3_json, mistral, each with a
  template in its format) parses the model's own text (steered into the format with
  guided_regex), streams the arguments piece by piece and takes the call back in a round trip;
  a round trip through the `openai` client; the 400 table.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from kvserve.engine import SamplingParams
from kvserve.engine.generation_config import GenerationConfig
from kvserve.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from kvserve.server.chat import render_chat
from kvserve.server.config import ServerConfig
from kvserve.server.protocol import ChatMessage
from kvserve.server.tool_call_scanner import CallScanner
from kvserve.server.tool_parsers import (
    TOOL_PARSERS,
    FunctionCall,
    ToolPlan,
    ToolStreamer,
    extract_tool_calls,
    forced_schema,
)
from server_fixtures import ServerProcess, cached_server, server_checkpoint, wait_idle  # noqa: F401

# Hermes / Qwen2.5-style: tools in the system prompt, calls in <tool_call> tags, results as <tool_response>.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "required": ["city", "unit"],
            "additionalProperties": False,
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "required": ["zone"],
            "additionalProperties": False,
            "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
        },
    },
}
TOOLS = [WEATHER, TIME]
MSG = [{"role": "user", "content": "Weather in Paris?"}]

# ----------------------------------------------------------------------------- parsers on strings

CALL_TEXTS = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
    '{"name": "get_time", "parameters": {"zone": "cet"}}',
    "mistral": 'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
    '{"name": "get_time", "arguments": {"zone": "cet"}}]',
}
EXPECTED_CALLS = [
    FunctionCall("get_weather", '{"city": "Paris", "unit": "c"}'),
    FunctionCall("get_time", '{"zone": "cet"}'),
]
EXPECTED_CONTENT = {"hermes": "Let me check.", "llama3_json": None, "mistral": "Let me check."}


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_parser_finds_the_calls_and_the_content(parser):
    content, calls = TOOL_PARSERS[parser]().extract(CALL_TEXTS[parser])
    assert calls == EXPECTED_CALLS
    assert content == EXPECTED_CONTENT[parser]


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@pytest.mark.parametrize(
    "text",
    [
        "Just an answer, no call.",
        "  {not json at all",
        "",
        "a < b and [c] {d}",
        '<tool_call>{"name": "f", "arguments": {"a": </tool_call>',
        '[TOOL_CALLS] [{"arguments": {}}]',
        '{"no_name": 1}',
    ],
)
def test_parser_leaves_text_without_a_valid_call_as_content(parser, text):
    assert TOOL_PARSERS[parser]().extract(text) == (text, [])


def test_hermes_variants():
    hermes = TOOL_PARSERS["hermes"]()
    # an unclosed last call (the model stopped at EOS) still counts; arguments given as JSON text stay as they are
    content, calls = hermes.extract('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert content is None and calls == [FunctionCall("f", '{"a": 1}')]
    content, calls = hermes.extract('<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.')
    assert content == "Done." and calls == [FunctionCall("f", "{}")]


def test_forced_outputs_are_read_as_json():
    plan = ToolPlan("forced", is_array=True)
    text = '[{"name": "get_time", "arguments": {"zone": "utc"}}]'
    assert extract_tool_calls(text, plan) == (None, [FunctionCall("get_time", '{"zone": "utc"}')])
    assert extract_tool_calls('[{"name": "get_ti', plan) == (
        '[{"name": "get_ti',
        [],
    )  # cut off by max_tokens
    named = ToolPlan("forced")
    assert extract_tool_calls('{"name": "f", "arguments": {"x": [1]}}', named) == (
        None,
        [FunctionCall("f", '{"x": [1]}')],
    )


def test_forced_schema_shapes():
    named = forced_schema(TOOLS, "get_time")
    assert named["properties"]["name"] == {"const": "get_time"}
    assert named["properties"]["arguments"] == TIME["function"]["parameters"]
    required = forced_schema(TOOLS, "required")
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    assert [s["properties"]["name"]["const"] for s in required["items"]["anyOf"]] == [
        "get_weather",
        "get_time",
    ]
    assert forced_schema(TOOLS, "required", is_parallel=False)["maxItems"] == 1
    no_params = forced_schema([{"type": "function", "function": {"name": "ping"}}], "ping")
    assert no_params["properties"]["arguments"] == {"type": "object", "properties": {}}


def _stream(
    streamer: ToolStreamer, text: str, piece: int
) -> tuple[str, dict[int, list], list[dict], bool]:
    """Feed `text` in pieces: (content, {call index: [name, arguments]}, the deltas sent before the
    end, whether the choice made calls)."""
    content, calls, early = "", {}, []

    def take(deltas):
        for delta in deltas:
            (call,) = delta["tool_calls"]
            entry = calls.setdefault(call["index"], [None, ""])
            if "id" in call:
                assert (
                    call["id"].startswith("call_")
                    and call["type"] == "function"
                    and entry[0] is None
                )
                entry[0] = call["function"]["name"]
            entry[1] += call["function"]["arguments"]

    for i in range(0, len(text), piece):
        sent, deltas = streamer.feed(text[i : i + piece])
        content += sent
        early += deltas
        take(deltas)
    rest, deltas, made_calls = streamer.finish(text)
    take(deltas)
    return content + rest, calls, early, made_calls


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_streamer_pieces_reassemble_into_the_parsed_result(parser, piece):
    plan = ToolPlan("auto", parser)
    for text in (
        CALL_TEXTS[parser],
        "Plain answer.\n\nWith lines < and [brackets] {x}.  ",
        "  \n",
        'Hmm <tool_call>{"name": 1}</tool_call> [TOOL_CALLS] [{',
        ' {"name": "f", "parameters": {} x',
    ):
        content, calls, _, made_calls = _stream(ToolStreamer(plan), text, piece)
        expected_content, expected_calls = extract_tool_calls(text, plan)
        if calls and not expected_calls:
            # a call that was announced, then turned out malformed: what was sent stands, the text
            # from the call on is not repeated as content, and the finish reason stays the engine's
            start = TOOL_PARSERS[parser]().call_start(text)
            assert content == text[:start].rstrip() and not made_calls
            continue
        assert content == (expected_content or "")
        assert [tuple(calls[i]) for i in sorted(calls)] == [
            (c.name, c.arguments) for c in expected_calls
        ]
        assert made_calls == bool(expected_calls)
        if expected_calls:  # nothing of a call leaks into the content
            assert "{" not in content


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_streamer_sends_arguments_while_they_are_generated(parser):
    text = CALL_TEXTS[parser]
    _, calls, early, _ = _stream(ToolStreamer(ToolPlan("auto", parser)), text, 2)
    # both calls were announced, and their arguments arrived in many pieces, before the output ended
    early_args = [
        d["tool_calls"][0]["function"]["arguments"] for d in early if "id" not in d["tool_calls"][0]
    ]
    assert [calls[i][0] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert sum(1 for d in early if "id" in d["tool_calls"][0]) == 2 and len(early_args) > 10


def test_streamer_forced_compact_output_and_a_cut_off_call():
    plan = ToolPlan("forced", is_array=True)
    text = '[{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}},{"name":"get_time","arguments":{}}]'
    content, calls, early, made_calls = _stream(ToolStreamer(plan), text, 4)
    # arguments are the text the model wrote (compact here), streamed and non-streamed alike
    assert extract_tool_calls(text, plan)[1] == [
        FunctionCall("get_weather", '{"city":"Oslo","unit":"c"}'),
        FunctionCall("get_time", "{}"),
    ]
    assert (
        content == ""
        and made_calls
        and calls == {0: ["get_weather", '{"city":"Oslo","unit":"c"}'], 1: ["get_time", "{}"]}
    )
    # cut off by max_tokens: what was streamed stands, nothing more is added, no "tool_calls" finish
    cut = text[: text.index("slo")]
    content, calls, _, made_calls = _stream(ToolStreamer(plan), cut, 4)
    assert content == "" and not made_calls and calls == {0: ["get_weather", '{"city":"O']}


def test_scanner_finds_calls_and_their_raw_arguments():
    text = '<x> [{"arguments": {"a": "}\\"", "b": [1, {"c": 2}]} , "name": "f\\u00e9"}, "junk", {"name": "g"}]'
    calls = CallScanner(0).feed(text)
    assert [(c.name, c.arguments(text), c.is_complete) for c in calls] == [
        ("f\u00e9", '{"a": "}\\"", "b": [1, {"c": 2}]}', True),
        ("g", None, True),
    ]
    scanner = CallScanner(0)
    for i in range(len(text)):  # the same, one character at a time
        scanner.feed(text[: i + 1])
    assert [(c.name, c.arguments(text)) for c in scanner.calls] == [
        (c.name, c.arguments(text)) for c in calls
    ]
    string_args = '{"name": "f", "arguments": "{\\"a\\": 1}"}'
    assert (
        CallScanner(0).feed(string_args)[0].arguments(string_args) is None
    )  # known only once parsed


def test_streamer_holds_back_a_possible_marker_only():
    streamer = ToolStreamer(ToolPlan("auto", "hermes"))
    assert streamer.feed("Hello <tool") == ("Hello", [])
    assert streamer.feed("box> there") == (" <toolbox> there", [])


def test_chat_template_renders_tools_and_tool_messages(tmp_path):
    from checkpoints import save_tokenizer

    tokenizer = save_tokenizer(tmp_path)
    history = [
        ChatMessage(role="user", content="Weather?"),
        ChatMessage(
            role="assistant",
            content=None,
            tool_calls=[
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo", "unit": "c"}',
                    },
                }
            ],
        ),
        ChatMessage(role="tool", content="-3 C", tool_call_id="call_1"),
    ]
    text = render_chat(tokenizer, HERMES_TEMPLATE, history, tools=TOOLS)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}' in text
    assert "<tool_response>\n-3 C\n</tool_response>" in text
    assert "<tools>" not in render_chat(tokenizer, HERMES_TEMPLATE, history)


# ----------------------------------------------------------------------------- tool_choice auto on a scripted engine


class ScriptedEngine:
    """Answers every request with `text`, a few characters per step (tool_choice auto needs a model
    that writes a call; a random one does not)."""

    def __init__(self, tokenizer, text: str) -> None:
        self.tokenizer = tokenizer
        self.text = text
        self.chat_template = None
        self.model_config = SimpleNamespace(
            model_path="/scripted",
            dtype="float32",
            device="cpu",
            max_model_len=4096,
            vocab_size=len(tokenizer),
            block_size=16,
            quantization="none",
            weight_bytes=0,
            eos_token_ids=(),
            decoder_start_token_id=None,
            generation_config=GenerationConfig(),
        )
        self.is_healthy = True
        self.params: list[SamplingParams] = []

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 1000, 1000, 0, 0, 0, 0, 0)

    async def generate(self, prompt, params: SamplingParams, request_id: str):
        self.params.append(params)
        metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=0.2)
        pieces = [self.text[i : i + 5] for i in range(0, len(self.text), 5)]
        for step, piece in enumerate(pieces):
            done = step == len(pieces) - 1
            out = CompletionOutput(
                index=0,
                text="".join(pieces[: step + 1]),
                token_ids=list(range(step + 1)),
                finish_reason="stop" if done else None,
                delta_text=piece,
                delta_token_ids=[step],
            )
            yield RequestOutput(
                request_id, None, list(prompt), [out], finished=done, metrics=metrics
            )

    async def abort(self, request_id: str) -> None:
        pass

    async def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from checkpoints import save_tokenizer

    return save_tokenizer(tmp_path_factory.mktemp("tools_tokenizer"))


def _scripted_client(tokenizer, text: str, parser: str) -> tuple[ScriptedEngine, TestClient]:
    from kvserve.server.app import create_app

    engine = ScriptedEngine(tokenizer, text)
    config = ServerConfig(
        stats_log_interval=0, chat_template=HERMES_TEMPLATE, tool_call_parser=parser
    )
    return engine, TestClient(create_app(config, engine=engine))


def _reassemble(lines: list[str]) -> dict:
    """A streamed choice put back together as a non-streamed one would be."""
    content, calls, finish_reason = "", {}, None
    for line in lines:
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
                entry["id"] = call.get("id", entry["id"])
                entry["name"] = call.get("function", {}).get("name", entry["name"])
                entry["arguments"] += call.get("function", {}).get("arguments", "")
            finish_reason = choice["finish_reason"] or finish_reason
    return {
        "content": content or None,
        "finish_reason": finish_reason,
        "calls": [(c["name"], c["arguments"]) for _, c in sorted(calls.items())],
        "ids": [c["id"] for _, c in sorted(calls.items())],
    }


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_auto_parses_calls_and_streams_the_same(tokenizer, parser):
    engine, client = _scripted_client(tokenizer, CALL_TEXTS[parser], parser)
    with client:
        body = {"messages": MSG, "tools": TOOLS, "max_tokens": 50}
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] == EXPECTED_CONTENT[parser]
        assert [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
        ] == [(c.name, c.arguments) for c in EXPECTED_CALLS]
        assert all(
            c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"]
        )
        assert engine.params[-1].skip_special_tokens is (
            parser != "mistral"
        )  # [TOOL_CALLS] is a special token

        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            streamed = _reassemble(list(stream.iter_lines()))
        assert (
            streamed["content"] == message["content"] and streamed["finish_reason"] == "tool_calls"
        )
        assert streamed["calls"] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
        ]
        assert all(i and i.startswith("call_") for i in streamed["ids"])


def test_auto_without_a_parser_and_none_give_plain_text(tokenizer):
    engine, client = _scripted_client(tokenizer, CALL_TEXTS["hermes"], "none")
    with client:
        for choice in ("auto", "none"):
            resp = client.post(
                "/v1/chat/completions",
                json={"messages": MSG, "tools": TOOLS, "tool_choice": choice},
            )
            message = resp.json()["choices"][0]["message"]
            assert message["content"] == CALL_TEXTS["hermes"] and message["tool_calls"] is None
    _, client = _scripted_client(tokenizer, CALL_TEXTS["hermes"], "hermes")
    with client:  # "none": the output is not parsed (and the tools are not rendered)
        resp = client.post(
            "/v1/chat/completions", json={"messages": MSG, "tools": TOOLS, "tool_choice": "none"}
        )
        assert resp.json()["choices"][0]["message"]["tool_calls"] is None
        assert resp.json()["choices"][0]["finish_reason"] == "stop"


# ----------------------------------------------------------------------------- a real server on a random model


@pytest.fixture(scope="module")
def tools_server(server_checkpoint, tmp_path_factory):  # noqa: F811
    template = Path(tmp_path_factory.mktemp("tools_template")) / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    srv = cached_server(
        "tools",
        server_checkpoint,
        "--chat-template",
        str(template),
        "--tool-call-parser",
        "hermes",
        "--served-model-name",
        "x",
    )
    yield srv
    srv.stop()


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=120)


def _check_call(call, tools=TOOLS) -> dict:
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    assert set(args) == set(spec["parameters"]["required"])
    for key, value in args.items():
        prop = spec["parameters"]["properties"][key]
        assert value in prop["enum"] if "enum" in prop else len(value) <= prop["maxLength"]
    assert call.id.startswith("call_") and call.type == "function"
    return args


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_and_required_are_enforced_on_a_random_model(tools_server, seed):
    client = _client(tools_server)
    named = client.chat.completions.create(
        model="x",
        messages=MSG,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=1.0,
        seed=seed,
        max_tokens=200,
    )
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    _check_call(choice.message.tool_calls[0])
    required = client.chat.completions.create(
        model="x",
        messages=MSG,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=seed,
        max_tokens=200,
    )
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    _check_call(calls[0])


def test_tool_call_round_trip(tools_server):
    client = _client(tools_server)
    first = client.chat.completions.create(
        model="x",
        messages=MSG,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
    )
    call = first.choices[0].message.tool_calls[0]
    _check_call(call)
    history = [
        *MSG,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    second = client.chat.completions.create(model="x", messages=history, tools=TOOLS, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the tool result reached the prompt: it is longer than the first by at least the call and the result
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    wait_idle(tools_server.url)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_tool_calls_equal_the_non_streamed_result(tools_server, tool_choice):
    body = {
        "messages": MSG,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 0,
        "max_tokens": 200,
        "parallel_tool_calls": False,
    }
    whole = httpx.post(tools_server.base_url + "/chat/completions", json=body, timeout=120).json()[
        "choices"
    ][0]
    with httpx.stream(
        "POST",
        tools_server.base_url + "/chat/completions",
        json={**body, "stream": True},
        timeout=120,
    ) as resp:
        streamed = _reassemble(list(resp.iter_lines()))
    assert streamed["finish_reason"] == whole["finish_reason"] == "tool_calls"
    assert streamed["content"] == whole["message"]["content"] is None
    assert streamed["calls"] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]
    ]


# Llama 3.x-style and Mistral-style templates: tools in the prompt, calls and results in each format.
LLAMA3_TEMPLATE = """\
{%- for message in messages %}<|start_header_id|>{{ 'ipython' if message.role == 'tool' else message.role }}\
<|end_header_id|>
{% if loop.first and tools %}Tools: {{ tools | tojson }}
{% endif %}
{%- if message.tool_calls %}<|python_tag|>
{%- for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": \
{{ call.function.arguments }}}{% if not loop.last %}; {% endif %}{% endfor %}
{%- else %}{{ message.content }}{% endif %}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>
{% endif %}"""
MISTRAL_TEMPLATE = """\
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- elif message.tool_calls %}[TOOL_CALLS][
{%- for call in message.tool_calls %}{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments }}}{% if not loop.last %}, {% endif %}{% endfor %}]</s>
{%- else %}{{ message.content }}</s>{% endif %}
{%- endfor %}"""
TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3_json": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}
_ARGS = r'\{"city": "(Oslo|Paris)", "unit": "(c|f)"\}'
CALL_REGEX = {  # the call in each parser's format, with some text before it where the format has content
    "hermes": r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    + _ARGS
    + r"\}\n</tool_call>",
    "llama3_json": r'\{"name": "get_weather", "parameters": ' + _ARGS + r"\}",
    "mistral": r'Checking\. \[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": '
    + _ARGS
    + r"\}\]",
}


@pytest.fixture(scope="module", params=sorted(TOOL_PARSERS))
def parser_server(request, server_checkpoint, tools_server, tmp_path_factory):  # noqa: F811
    """A real server per parser, with a chat template that renders tools, calls and results in its format."""
    parser = request.param
    if parser == "hermes":
        return parser, tools_server
    template = Path(tmp_path_factory.mktemp(f"{parser}_template")) / "template.jinja"
    template.write_text(TEMPLATES[parser])
    srv = cached_server(
        f"tools-{parser}",
        server_checkpoint,
        "--chat-template",
        str(template),
        "--tool-call-parser",
        parser,
        "--served-model-name",
        "x",
    )
    request.addfinalizer(srv.stop)
    return parser, srv


def test_auto_round_trip_on_a_real_model_for_each_parser(parser_server):
    """tool_choice auto end to end, per parser: the tools are rendered, the model's own text is
    parsed by --tool-call-parser, streamed calls equal the non-streamed ones, and the call and its
    result go back into the history. A random model would not write a call by itself, so its
    output is steered into the parser's format with vLLM's guided_regex extra (auto constrains
    nothing of its own)."""
    parser, srv = parser_server
    body = {
        "messages": MSG,
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": 3,
        "guided_regex": CALL_REGEX[parser],
    }
    first = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=120).json()
    message = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == (None if parser == "llama3_json" else "Checking.")
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Oslo", "Paris")
    with httpx.stream(
        "POST", srv.base_url + "/chat/completions", json={**body, "stream": True}, timeout=120
    ) as resp:
        lines = list(resp.iter_lines())
    streamed = _reassemble(lines)
    assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == message["content"]
    assert streamed["calls"] == [(call["function"]["name"], call["function"]["arguments"])]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    pieces = [
        c
        for chunk in chunks
        for choice in chunk["choices"]
        for c in choice["delta"].get("tool_calls") or []
        if "id" not in c and c["function"]["arguments"]
    ]
    assert len(pieces) > 1  # the arguments came as they were generated, not in one piece at the end
    # the round trip: the call and the tool's result go back, rendered in the parser's format
    history = [
        *MSG,
        {"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]},
        {"role": "tool", "tool_call_id": call["id"], "content": "-3 C"},
    ]
    second = httpx.post(
        srv.base_url + "/chat/completions",
        timeout=120,
        json={"messages": history, "tools": TOOLS, "max_tokens": 8},
    ).json()
    assert second["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    assert (
        second["usage"]["prompt_tokens"]
        > first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    )
    wait_idle(srv.url)


BAD = [
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "'nope'",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice"),
    (
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
        "tools",
        "tools.0.function.name",
    ),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "'bad name!'"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1, 2]}}]},
        "tools",
        "parameters",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        },
        "tools",
        "'string'",
    ),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools.0"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "not": {}}},
                }
            ],
            "tool_choice": "required",
        },
        "tools",
        "'not'",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "response_format",
    ),
]


@pytest.mark.parametrize(("extra", "param", "text"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_tools_are_a_400(tools_server, extra, param, text):
    resp = httpx.post(
        tools_server.base_url + "/chat/completions",
        json={"messages": MSG, "max_tokens": 4, **extra},
        timeout=60,
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and text in error["message"], error


def test_langchain_bind_tools(tools_server):
    langchain_openai = pytest.importorskip("langchain_openai")

    llm = langchain_openai.ChatOpenAI(
        base_url=tools_server.base_url, api_key="none", model="x", max_tokens=200, max_retries=0
    )
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert set(message.tool_calls[0]["args"]) == {"city", "unit"}
