"""The nesting-depth limit on JSON request bodies, checked on the raw bytes before anything parses them.

Python's `json` module, Pydantic's before-validators, Jinja's `tojson`, pickle and the JSON-schema
checks all recurse once (or more) per level of nesting; a small body nested a few hundred levels
deep would exhaust the interpreter's stack in one of them. `json_depth` measures the nesting
without parsing or recursing: it blanks the escaped quotes (two `bytes.replace`), finds the quote
and bracket bytes with numpy, and ignores the brackets that lie inside strings. A body within
`--max-body-bytes` costs a few passes over its bytes; a body with at most `MAX_JSON_DEPTH`
brackets in all (most small requests) is passed after counting them.
"""

from __future__ import annotations

import numpy as np

from kvserve.server.errors import APIError

# The deepest nesting of arrays and objects accepted in a request, at any place in it. Real requests
# stay far below it (a chat message's content part sits at depth 4, a tool's parameters at 4 plus the
# schema's own nesting, about two levels per nested object); serde_json, behind most Rust servers,
# stops at about the same depth. Every recursive walk of request data in the server then stays far
# inside Python's default recursion limit (1000 frames).
MAX_JSON_DEPTH = 128

_QUOTE, _OPEN, _CLOSE = ord('"'), ord("{"), ord("}")


def json_depth(body: bytes, stop_above: int = MAX_JSON_DEPTH) -> int:
    """How deeply arrays and objects nest in the JSON text `body` (0 for a scalar), brackets inside
    strings ignored. When the body has at most `stop_above` opening brackets in all, that count (a
    bound on the depth) is returned without a closer look. Meant for valid JSON; on other bytes it
    returns some number (the parser refuses those anyway)."""
    num_opening = body.count(b"[") + body.count(b"{")
    if num_opening <= stop_above:
        return num_opening
    if b"\\" in body:
        # Inside a string a backslash and the byte after it are one escape, so pairing a run of
        # backslashes from its left leaves one only where the run is odd, and then it escapes the next
        # byte. Blanking the pairs, then the escaped quotes, keeps every other byte where it was.
        body = body.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    data = np.frombuffer(body, dtype=np.uint8)
    folded = data | 0x20  # "[" -> "{" and "]" -> "}"; no other byte becomes either
    brackets = np.flatnonzero((folded == _OPEN) | (folded == _CLOSE))
    quotes = np.flatnonzero(data == _QUOTE)  # each one opens or closes a string
    # a bracket lies inside a string when an odd number of string quotes comes before it
    brackets = brackets[np.searchsorted(quotes, brackets) % 2 == 0]
    steps = np.where(folded[brackets] == _OPEN, 1, -1)
    return int(np.cumsum(steps).max(initial=0))


def too_deep_message(what: str = "the request body", depth_limit: int = MAX_JSON_DEPTH) -> str:
    return (
        f"{what} nests JSON arrays and objects more than {depth_limit} levels deep; the server accepts "
        f"at most {depth_limit} levels"
    )


def check_json_depth(text: str | bytes, param: str, depth_limit: int = MAX_JSON_DEPTH) -> None:
    """400 (`json_too_deep`) when the JSON text `text`, found in the request's field `param` (a schema
    sent as a string), nests deeper than `depth_limit`."""
    body = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if json_depth(body, depth_limit) > depth_limit:
        raise APIError(400, too_deep_message(param, depth_limit), param=param, code="json_too_deep")
