"""The JSON Schema walk: measures a schema and refuses keywords the grammar cannot enforce. A leaf
module: request validation (engine/sampling_params.py) uses it without the engine's options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# JSON Schema keywords xgrammar would silently ignore: refused so that a "valid" output
# never violates the schema the user gave
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentSchemas",
        "dependentRequired",
        "dependencies",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "unevaluatedItems",
        "unevaluatedProperties",
        "propertyNames",
        "$dynamicRef",
        "$recursiveRef",
    }
)
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
            raise ValueError(
                f"the JSON schema is nested more than {max_depth} levels deep, at "
                f"{_where(path)} (max_schema_depth={max_depth})"
            )
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
        stack += reversed(
            children
        )  # depth first, in document order: the first bad keyword is reported
    return size


def _where(path: Any, max_chars: int = 200) -> str:
    """A JSON pointer (`#/properties/a`) from walk_schema's linked path; long ones keep their end."""
    keys = []
    while path is not None:
        path, key = path
        keys.append(str(key))
    text = "/".join(["#", *reversed(keys)])
    return text if len(text) <= max_chars else "#/.../" + text[-max_chars:]
