"""How big an output constraint may be: bounds on what the grammar compiler is given.

A grammar's compile time grows with its size (and, for some shapes, faster than its size), and
it runs in the engine core beside the step loop. These bounds keep the largest grammar a
client can ask for compilable in about a second (docs/security.md, "Grammar work"); the
compile time limit (`--grammar-compile-timeout-s`) catches the rest. The bounds themselves
(`GrammarLimits`) are engine options, declared with their defaults on `EngineArgs`.

The schema walk is iterative: a schema nested deeper than Python's recursion limit (possible
from the offline API) is measured and refused, never a RecursionError.
"""

from __future__ import annotations

from typing import Any

from kvserve.engine.config import GrammarLimits  # the bounds, declared with the other options
from kvserve.engine.structured_output.schema import walk_schema


def check_schema_limits(schema: Any, limits: GrammarLimits) -> None:
    size = walk_schema(schema, limits.max_schema_depth)
    for what, value, option in (
        ("object properties", size.num_properties, "max_schema_properties"),
        ("enum values", size.num_enum_values, "max_schema_enum_values"),
        (
            "characters of property names, enum and const values and patterns",
            size.num_string_chars,
            "max_schema_string_chars",
        ),
    ):
        limit = getattr(limits, option)
        if value > limit:
            raise ValueError(
                f"the JSON schema has {value} {what}; at most {limit} are allowed ({option}={limit})"
            )


def check_limits(spec: Any, limits: GrammarLimits) -> None:
    """ValueError ("structured_outputs.<kind>: ...") if `spec` (a `StructuredOutputs`) is over
    one of `limits`, naming the limit and the value."""
    kind = spec.kind
    try:
        if kind == "json":
            check_schema_limits(spec.json, limits)
        elif kind in ("regex", "grammar"):
            _check_count(len(getattr(spec, kind)), f"max_{kind}_chars", "characters", limits)
        elif kind == "choice":
            _check_count(len(spec.choice), "max_choices", "strings", limits)
            _check_count(
                sum(len(c) for c in spec.choice), "max_choice_chars", "characters in all", limits
            )
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind}: {e}") from None


def _check_count(value: int, option: str, what: str, limits: GrammarLimits) -> None:
    limit = getattr(limits, option)
    if value > limit:
        raise ValueError(f"{value} {what}; at most {limit} are allowed ({option}={limit})")
