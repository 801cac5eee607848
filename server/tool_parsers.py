"""Tool calling on /v1/chat/completions: check `tools`/`tool_choice`, enforce or parse the calls.

- `tool_choice` "required" or a named function is ENFORCED: decoding is constrained to a JSON
  schema of the call(s) (`forced_schema`), and the output is read directly as the calls,
  whatever format the checkpoint would use on its own.
- "auto" renders the tools and parses the free text with the parser chosen by
  `--tool-call-parser` (`TOOL_PARSERS`: hermes, llama3_json, mistral); without one the output
  stays plain text.
- "none" neither renders the tools nor parses the output.

`ToolStreamer` turns a streamed choice into content deltas and `delta.tool_calls` chunks whose
arguments stream as they are generated (server/tool_call_scanner.py finds them in the partial
text); text that may start a call is held back, so the streamed content equals the non-streamed
`content`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from kvserve.server.errors import bad_request
from kvserve.server.tool_call_scanner import CallScanner

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's function-name rule (plus '.')
JSONDecoder = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """One parsed call: `arguments` is JSON text (OpenAI sends it as a string)."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's `tools`/`tool_choice` ask of the output.

    `mode` "forced": the output is the JSON of the call(s) (`is_array`: a list of them, for
    "required"); "auto": the output is parsed with `parser` (None: no parsing).
    """

    mode: Literal["auto", "forced"]
    parser: str | None = None
    is_array: bool = False


# ----------------------------------------------------------------------------- request checks


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The tools with each one's shape checked; 400 (param `tools.N...`) for a malformed one."""
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(
                f'tools.{i}: each tool must be {{"type": "function", "function": {{...}}}}',
                param="tools",
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"tools.{i}.function must be an object with a name", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"tools.{i}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                param="tools",
            )
        if name in names:
            raise bad_request(f"tools.{i}.function.name {name!r} is given twice", param="tools")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"tools.{i}.function.description must be a string", param="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(
                f"tools.{i}.function.parameters must be a JSON Schema object, got "
                f"{type(parameters).__name__} {str(parameters)[:60]!r}",
                param="tools",
            )
        if isinstance(parameters, dict) and parameters.get("type", "object") != "object":
            raise bad_request(
                f"tools.{i}.function.parameters must have type 'object', got {parameters['type']!r}",
                param="tools",
            )
    return tools


def check_tool_choice(tool_choice: Any, tools: list[dict[str, Any]]) -> str:
    """ "none", "auto", "required" or the named function's name; 400 (param `tool_choice`) otherwise."""
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(
                f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                f'"function": {{"name": ...}}}}, got {tool_choice!r}',
                param="tool_choice",
            )
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(name, str)
    ):
        raise bad_request(
            f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
            f'"function": {{"name": ...}}}}, got {str(tool_choice)[:100]!r}',
            param="tool_choice",
        )
    known = [t["function"]["name"] for t in tools]
    if name not in known:
        raise bad_request(
            f"tool_choice names function {name!r}, which is not in tools ({', '.join(known)})",
            param="tool_choice",
        )
    return name


def forced_schema(
    tools: list[dict[str, Any]], choice: str, is_parallel: bool = True
) -> dict[str, Any]:
    """The JSON schema that enforces `choice` ("required" or a function's name).

    A named function: `{"name": <const>, "arguments": <its parameters>}`. "required": an array
    (one item when `parallel_tool_calls` is false) of such objects, any tool in each.
    """

    def call(tool: dict[str, Any]) -> dict[str, Any]:
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        return {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    if choice != "required":
        return call(next(t for t in tools if t["function"]["name"] == choice))
    calls = [call(t) for t in tools]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not is_parallel:
        array["maxItems"] = 1
    return array


# ----------------------------------------------------------------------------- parsing


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, arguments_key: str = "arguments") -> FunctionCall | None:
    """A call from a parsed `{"name": ..., "arguments": {...}}` (or `parameters`), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # already JSON text
        return FunctionCall(obj["name"], arguments)
    return FunctionCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _calls(objs: list[Any], arguments_key: str = "arguments") -> list[FunctionCall] | None:
    calls = [_call(obj, arguments_key) for obj in objs]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def _content(*parts: str) -> str | None:
    """Text left around the calls: the part before them keeps its leading whitespace (it may have
    been streamed already), the rest is stripped."""
    kept = [p for p in (parts[0].rstrip(), *(p.strip() for p in parts[1:])) if p]
    return "\n".join(kept) or None


class ToolParser:
    """Finds tool calls in free text. `markers` start a call: text before the first one streams."""

    name = ""
    markers: tuple[str, ...] = ()
    needs_special_tokens = (
        False  # the marker is a special token: decode with skip_special_tokens=False
    )

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """(content, calls); a malformed call leaves the whole text as content."""
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where a call starts in `text` (None: not yet); the text before it is content."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """How many characters at the end of `text` may be the start of a marker."""
        for size in range(min(len(text), max(map(len, self.markers), default=0) - 1), 0, -1):
            if any(m.startswith(text[-size:]) for m in self.markers):
                return size
        return 0


class HermesParser(ToolParser):
    """Hermes / Qwen2.5: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated."""

    name = "hermes"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = self.call_start(text)
        if start is None:
            return text, []
        objs, end = [], start
        for match in self._CALL.finditer(text, start):
            if text[end : match.start()].strip():  # text between calls: keep it as content
                break
            try:
                objs.append(json.loads(match.group(1)))
            except json.JSONDecodeError:
                return text, []
            end = match.end()
        calls = _calls(objs)
        return (text, []) if calls is None else (_content(text[:start], text[end:]), calls)


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calling: the whole output is `{"name": ..., "parameters": {...}}`
    (optionally after `<|python_tag|>`, several separated by `;`); other output is content."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.markers):
            return len(text) - len(stripped)
        return None

    def held_back(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if not stripped or "<|python_tag|>".startswith(stripped) else 0

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = self.call_start(text)
        if start is None:
            return text, []
        body = text[start:].removeprefix("<|python_tag|>").strip()
        objs, pos = [], 0
        try:
            while pos < len(body):
                obj, pos = JSONDecoder.raw_decode(body, pos)
                objs.append(obj)
                rest = body[pos:].lstrip()
                if rest and not rest.startswith(";"):
                    return text, []
                pos = len(body) - len(rest) + (1 if rest else 0)
                while pos < len(body) and body[pos].isspace():
                    pos += 1
        except json.JSONDecodeError:
            return text, []
        calls = _calls(objs, "parameters")
        return (text, []) if calls is None else (_content(text[:start]), calls)


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the marker is a special token)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    needs_special_tokens = True

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = self.call_start(text)
        if start is None:
            return text, []
        body = text[start + len(self.markers[0]) :].lstrip()
        try:
            value, end = JSONDecoder.raw_decode(body)
        except json.JSONDecodeError:
            return text, []
        calls = _calls(value if isinstance(value, list) else [value])
        return (text, []) if calls is None else (_content(text[:start], body[end:]), calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def extract_forced(text: str, plan: ToolPlan) -> tuple[str | None, list[FunctionCall]]:
    """The calls of a grammar-enforced output (a cut-off output stays content)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    calls = _calls(value if plan.is_array and isinstance(value, list) else [value])
    return (text, []) if calls is None else (None, calls)


def extract_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[FunctionCall]]:
    """(content, calls) of a finished choice under `plan`; each call's arguments are the JSON text
    the model wrote (what a stream sends piece by piece), not a re-serialization."""
    if plan.mode == "forced":
        content, calls = extract_forced(text, plan)
        start = 0
    elif plan.parser is None:
        return text, []
    else:
        parser = TOOL_PARSERS[plan.parser]()
        content, calls = parser.extract(text)
        start = parser.call_start(text) or 0
    return content, _with_raw_arguments(text, start, calls)


def _with_raw_arguments(text: str, start: int, calls: list[FunctionCall]) -> list[FunctionCall]:
    """`calls` with the generated text of their arguments, where the scan finds the same calls."""
    if not calls:
        return calls
    scanned = [c for c in CallScanner(start).feed(text) if c.name is not None][: len(calls)]
    if [c.name for c in scanned] != [c.name for c in calls]:
        return calls
    result = []
    for call, found in zip(calls, scanned):
        raw = found.arguments(text) if found.is_complete else None
        try:
            same = raw is not None and json.loads(raw) == json.loads(call.arguments)
        except json.JSONDecodeError:
            same = False
        result.append(FunctionCall(call.name, raw) if same and raw is not None else call)
    return result


# ----------------------------------------------------------------------------- streaming


def call_header_delta(index: int, name: str) -> dict[str, Any]:
    """The first `delta.tool_calls` chunk of a call: its id, type and name (OpenAI's shape)."""
    return {
        "tool_calls": [
            {
                "index": index,
                "id": new_call_id(),
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        ]
    }


def call_arguments_delta(index: int, arguments: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


class ToolStreamer:
    """One streamed choice: `feed` returns the content that is safe to send now and the
    `delta.tool_calls` chunks of the calls so far; `finish` the rest of both.

    Content that may start a call is held back. Once a call has started, each call is announced
    when its name is complete and its arguments then stream as the model writes them, in order
    (OpenAI's shape). At the end the whole output is parsed: when it confirms the calls streamed
    so far (the same names, arguments that continue what was sent), the rest follows; a call the
    parse does not confirm (cut off by max_tokens, or malformed) keeps what was sent and gets
    nothing more, and the choice ends with the engine's finish reason.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = TOOL_PARSERS[plan.parser]() if plan.mode == "auto" and plan.parser else None
        self.text = ""
        self.num_sent = 0
        self.is_buffering = plan.mode == "forced"
        self.scanner = CallScanner(0) if plan.mode == "forced" else None  # set when a call starts
        self.sent_calls: list[tuple[str, str]] = []  # (name, arguments sent) per announced call

    def feed(self, delta_text: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta_text
        content = self._content()
        return content, self._call_deltas()

    def _content(self) -> str:
        if self.is_buffering:
            return ""
        end = len(self.text)
        if self.parser is not None:
            start = self.parser.call_start(self.text)
            if start is not None:
                self.is_buffering = True
                self.scanner = CallScanner(start)
                end = start
            else:
                end -= self.parser.held_back(self.text)
            end = len(
                self.text[:end].rstrip()
            )  # trailing whitespace may precede a call (then it is dropped)
        if end <= self.num_sent:
            return ""
        delta, self.num_sent = self.text[self.num_sent : end], end
        return delta

    def _call_deltas(self) -> list[dict[str, Any]]:
        if self.scanner is None:
            return []
        deltas = []
        for index, call in enumerate(self.scanner.feed(self.text)):
            if call.name is None:
                break  # calls are announced in order
            if index == len(self.sent_calls):
                deltas.append(call_header_delta(index, call.name))
                self.sent_calls.append((call.name, ""))
            arguments = call.arguments(self.text)
            sent = self.sent_calls[index][1]
            if arguments is not None and len(arguments) > len(sent):
                deltas.append(call_arguments_delta(index, arguments[len(sent) :]))
                self.sent_calls[index] = (call.name, arguments)
        return deltas

    def finish(self, text: str) -> tuple[str, list[dict[str, Any]], bool]:
        """(content not sent yet, the calls' remaining deltas, whether the choice made calls)
        from the whole output `text`."""
        content, calls = extract_tool_calls(text, self.plan)
        if self.sent_calls and not self._confirms(calls):
            return "", [], False
        deltas = []
        for index, call in enumerate(calls):
            sent = ""
            if index < len(self.sent_calls):
                sent = self.sent_calls[index][1]
            else:
                deltas.append(call_header_delta(index, call.name))
            if len(call.arguments) > len(sent):
                deltas.append(call_arguments_delta(index, call.arguments[len(sent) :]))
        content = content or ""
        sent_content = self.text[: self.num_sent]
        if not content.startswith(
            sent_content
        ):  # cannot happen: content begins with the text before any call
            return text[self.num_sent :], deltas, bool(calls)
        return content[self.num_sent :], deltas, bool(calls)

    def _confirms(self, calls: list[FunctionCall]) -> bool:
        return len(calls) >= len(self.sent_calls) and all(
            call.name == name and call.arguments.startswith(sent)
            for call, (name, sent) in zip(calls, self.sent_calls)
        )


def plan_tools(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None, parser: str | None
) -> tuple[list[dict[str, Any]] | None, ToolPlan | None, dict[str, Any] | None]:
    """(tools to render, plan, JSON schema to enforce) for a chat request; 400s for bad input.

    "none" (or no tools) renders nothing and parses nothing: (None, None, None).
    """
    if tool_choice is not None and not tools:  # OpenAI refuses it too
        raise bad_request("tool_choice is only allowed when tools are given", param="tool_choice")
    if not tools:
        return None, None, None
    checked = check_tools(tools)
    choice = check_tool_choice(tool_choice, checked)
    if choice == "none":
        return None, None, None
    if choice == "auto":
        return checked, ToolPlan("auto", parser), None
    schema = forced_schema(checked, choice, parallel_tool_calls is not False)
    return checked, ToolPlan("forced", is_array=choice == "required"), schema
