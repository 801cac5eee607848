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

from dataclasses import dataclass
from typing import Any

from kvserve.engine.config import GrammarLimits  # the bounds, declared with the other options

# JSON Schema keywords xgrammar would silently ignore: refused so that a "valid" output
# never violates the schema the user gave
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
    "uniqueItems", "contains", "minContains", "maxContains", "unevaluatedItems",
    "unevaluatedProperties", "propertyNames", "$dynamicRef", "$recursiveRef",
})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems")


@dataclass(slots=True)
class SchemaSize:
    """What `walk_schema` measured."""

    num_properties: int = 0
    max_depth: int = 0
    num_enum_values: int = 0
    num_string_chars: int = 0


def walk_schema(schema: Any, max_depth: int | None = None) -> SchemaSize:
    """Measure `schema` and refuse keywords the grammar cannot enforce (ValueError naming the
    first one and where). Stops with a ValueError as soon as it is deeper than `max_depth`."""
    size = SchemaSize()
    # (subschema, its path as a linked list (parent path, key), depth): O(1) per node at any depth
    stack: list[tuple[Any, Any, int]] = [(schema, None, 0)]
    while stack:
        node, path, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        size.max_depth = max(size.max_depth, depth)
        if max_depth is not None and depth > max_depth:
            raise ValueError(f"the JSON schema is nested more than {max_depth} levels deep, at "
                             f"{_where(path)} (max_schema_depth={max_depth})")
        children: list[tuple[Any, Any, int]] = []
        for key, value in node.items():
            if key in UNSUPPORTED_SCHEMA_KEYWORDS:
                raise ValueError(f"unsupported JSON Schema keyword {key!r} at {_where(path)}")
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                if key == "properties":
                    size.num_properties += len(value)
                size.num_string_chars += sum(len(name) for name in value)
                children += [(sub, ((path, key), name), depth + 1) for name, sub in value.items()]
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                children += [(sub, ((path, key), i), depth + 1) for i, sub in enumerate(value)]
            elif key in _SCHEMA_VALUES:
                children.append((value, (path, key), depth + 1))
            elif key == "enum" and isinstance(value, list):
                size.num_enum_values += len(value)
                size.num_string_chars += sum(len(v) for v in value if isinstance(v, str))
            elif key in ("const", "pattern") and isinstance(value, str):
                size.num_string_chars += len(value)
        stack += reversed(children)  # depth first, in document order: the first bad keyword is reported
    return size


def _where(path: Any, max_chars: int = 200) -> str:
    """A JSON pointer (`#/properties/a`) from walk_schema's linked path; long ones keep their end."""
    keys = []
    while path is not None:
        path, key = path
        keys.append(str(key))
    text = "/".join(["#", *reversed(keys)])
    return text if len(text) <= max_chars else "#/.../" + text[-max_chars:]


def check_schema_limits(schema: Any, limits: GrammarLimits) -> None:
    size = walk_schema(schema, limits.max_schema_depth)
    for what, value, option in (
            ("object properties", size.num_properties, "max_schema_properties"),
            ("enum values", size.num_enum_values, "max_schema_enum_values"),
            ("characters of property names, enum and const values and patterns", size.num_string_chars,
             "max_schema_string_chars")):
        limit = getattr(limits, option)
        if value > limit:
            raise ValueError(f"the JSON schema has {value} {what}; at most {limit} are allowed ({option}={limit})")


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
            _check_count(sum(len(c) for c in spec.choice), "max_choice_chars", "characters in all", limits)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind}: {e}") from None


def _check_count(value: int, option: str, what: str, limits: GrammarLimits) -> None:
    limit = getattr(limits, option)
    if value > limit:
        raise ValueError(f"{value} {what}; at most {limit} are allowed ({option}={limit})")
