"""`GET /tokenizer_info`: the served tokenizer's configuration.

Shaped like vLLM's endpoint (the tokenizer's `init_kwargs`, i.e. `tokenizer_config.json`, with
special tokens as plain strings and file paths left out, plus `tokenizer_class` and the chat
template in use), which lm-evaluation-harness's remote tokenizer probes: it needs `eos_token`
present and reads `bos_token`, `pad_token` and `chat_template`. `model_max_length` is the
server's context length, not the tokenizer file's placeholder (often 1e30).
"""

from __future__ import annotations

from typing import Any

from kvserve.server.protocol import TokenizerInfoResponse

_PATH_KEYS = (
    "name_or_path",
    "vocab_file",
    "merges_file",
    "tokenizer_file",
    "special_tokens_map_file",
)
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _plain(value: Any) -> Any:
    """JSON-ready: AddedToken -> its text, containers recursively, anything else odd -> str."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    content = getattr(value, "content", None)
    return content if isinstance(content, str) else str(value)


def tokenizer_info(
    tokenizer: Any, chat_template: str | None, max_model_len: int
) -> TokenizerInfoResponse:
    config = {
        key: _plain(value)
        for key, value in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
        if key not in _PATH_KEYS and not key.endswith("_file")
    }
    for name in _SPECIAL_TOKENS:
        token = getattr(tokenizer, name, None)
        config[name] = token if isinstance(token, str) else _plain(config.get(name))
    config.update(
        tokenizer_class=type(tokenizer).__name__,
        model_max_length=max_model_len,
        chat_template=chat_template,
    )
    return TokenizerInfoResponse(**config)
