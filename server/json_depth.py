"""The nesting-depth limit on JSON request bodies, checked on the raw bytes before anything parses them.

Python's `json` module, Pydantic's before-validators, Jinja's `tojson`, pickle and the JSON-schema
checks all recurse once (or more) per level of nesting; a 2 KB body nested a few hundred levels
deep would exhaust the interpreter's stack in one of them. `json_depth` measures the nesting
without parsing or recursing: it finds the quote and bracket bytes with numpy, drops the quotes
that a backslash escapes, and ignores the brackets that lie inside strings. A body within
`--max-body-bytes` costs a few passes over its bytes; a body with at most `MAX_JSON_DEPTH`
brackets in all (most small requests) is passed after counting them.
"""

from __future__ import annotations

import numpy as np

from server.errors import APIError

# The deepest nesting of arrays and objects accepted in a request, at any place in it. Real requests
# stay far below it (a chat message's content part sits at depth 4, a tool's parameters at 4 plus the
# schema's own nesting, about two levels per nested object); serde_json, behind most Rust servers,
# stops at about the same depth. Every recursive walk of request data in the server then stays far
# inside Python's default recursion limit (1000 frames).
MAX_JSON_DEPTH = 128

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN_BRACKETS, _CLOSE_BRACKETS = (ord("["), ord("{")), (ord("]"), ord("}"))


def _unescaped_quotes(data: np.ndarray, body: bytes) -> np.ndarray:
    """Positions of the `"` bytes that open or close a string (not preceded by an odd run of backslashes)."""
    quotes = np.flatnonzero(data == _QUOTE)
    if quotes.size == 0 or b"\\" not in body:
        return quotes
    backslashes = np.flatnonzero(data == _BACKSLASH)
    breaks = np.flatnonzero(np.diff(backslashes) != 1)           # runs of consecutive backslashes
    run_starts = backslashes[np.concatenate(([0], breaks + 1))]
    run_ends = backslashes[np.concatenate((breaks, [backslashes.size - 1]))]
    odd_run_ends = run_ends[(run_ends - run_starts) % 2 == 0]    # an odd run escapes the byte after it
    return quotes[~np.isin(quotes - 1, odd_run_ends)]


def json_depth(body: bytes, stop_above: int = MAX_JSON_DEPTH) -> int:
    """How deeply arrays and objects nest in the JSON text `body` (0 for a scalar), brackets inside
    strings ignored. When the body has at most `stop_above` opening brackets in all, that count (a
    bound on the depth) is returned without a closer look. Meant for valid JSON; on other bytes it
    returns some number (the parser refuses those anyway)."""
    num_opening = body.count(b"[") + body.count(b"{")
    if num_opening <= stop_above:
        return num_opening
    data = np.frombuffer(body, dtype=np.uint8)
    is_open = (data == _OPEN_BRACKETS[0]) | (data == _OPEN_BRACKETS[1])
    is_close = (data == _CLOSE_BRACKETS[0]) | (data == _CLOSE_BRACKETS[1])
    brackets = np.flatnonzero(is_open | is_close)
    quotes = _unescaped_quotes(data, body)
    # a bracket lies inside a string when an odd number of string quotes comes before it
    outside = np.searchsorted(quotes, brackets) % 2 == 0
    brackets = brackets[outside]
    steps = np.where(is_open[brackets], 1, -1)
    return int(np.cumsum(steps).max(initial=0))


def too_deep_message(what: str = "the request body", depth_limit: int = MAX_JSON_DEPTH) -> str:
    return (f"{what} nests JSON arrays and objects more than {depth_limit} levels deep; the server accepts "
            f"at most {depth_limit} levels")


def check_json_depth(text: str | bytes, param: str, depth_limit: int = MAX_JSON_DEPTH) -> None:
    """400 (`json_too_deep`) when the JSON text `text`, found in the request's field `param` (a schema
    sent as a string), nests deeper than `depth_limit`."""
    body = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if json_depth(body, depth_limit) > depth_limit:
        raise APIError(400, too_deep_message(param, depth_limit), param=param, code="json_too_deep")
