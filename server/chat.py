"""Chat templates: load `--chat-template`, render messages in a sandbox.

Rendering goes through `tokenizer.apply_chat_template(..., tokenize=False)`, which runs
the template in transformers' `ImmutableSandboxedEnvironment` with the helpers real
templates use (`raise_exception`, `strftime_now`, `tojson`) and the tokenizer's special
tokens in scope. Any failure of the template on a given conversation is the client's
problem (e.g. roles that do not alternate) and becomes a 400.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatMessage


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template` as a template string: read it if it names a file, else use it inline.

    Raises ValueError for a value that is neither a readable file nor valid Jinja.
    """
    if value is None:
        return None
    looks_inline = "{{" in value or "{%" in value
    path = Path(value).expanduser()
    if not looks_inline:
        try:
            if not path.is_file():
                raise ValueError(
                    f"--chat-template {value!r} is neither a file nor a Jinja template string"
                )
            value = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--chat-template {value!r} cannot be read: {exc}") from exc
    try:
        ImmutableSandboxedEnvironment().parse(value)
    except TemplateError as exc:
        raise ValueError(f"--chat-template is not a valid Jinja template: {exc}") from exc
    return value


def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict):  # not a valid text part
                kind = part.get("type")
                problem = (
                    "a text part needs a string 'text'"
                    if kind == "text"
                    else f"content part type {kind!r} is not supported (only 'text')"
                )
                raise bad_request(problem, param=f"messages.{index}.content")
            texts.append(part.text)
        content = "\n".join(texts)
    data["content"] = content if content is not None else ""
    return data


def render_chat(
    tokenizer: Any,
    template: str | None,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text for `messages` (and `tools`, which the template renders as it does);
    400 when there is no template or it fails on them."""
    if template is None:
        raise bad_request(
            "this model has no chat template; use /v1/completions or start the server with --chat-template",
            param="messages",
            code="chat_template_missing",
        )
    conversation = [_message_dict(i, m) for i, m in enumerate(messages)]
    kwargs = dict(template_kwargs or {})
    for reserved in (
        "conversation",
        "messages",
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "return_dict",
        "tools",
        "documents",
        "continue_final_message",
    ):
        kwargs.pop(reserved, None)
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=tools or None,
            **kwargs,
        )
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise bad_request(
            f"the chat template failed on these messages: {exc}", param="messages"
        ) from None
    if not isinstance(text, str):  # some transformers versions return a list for batched input
        text = text[0]
    return text
