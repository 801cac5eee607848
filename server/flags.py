"""Command-line flags generated from a pydantic settings model: one flag per field, named after it
(`max_num_seqs` -> `--max-num-seqs`), with its description, default and environment variable in
the help. `kvserve serve` and `kvserve ray` both build their parsers here, so an option written
once (on `EngineArgs`, `ServerConfig` or `RayOptions`) reads the same everywhere; its placeholder
(metavar) and other spellings come from that declaration too (`option(metavar=...)`,
`Field(json_schema_extra={"metavar": ...})`)."""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings


def _is_list(annotation: object) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _is_list(typing.get_args(annotation)[0])
    return origin is list


def _is_bool(annotation: object) -> bool:
    if annotation is bool:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return bool in typing.get_args(annotation)
    return False


def _choices(annotation: object) -> tuple[Any, ...] | None:
    """The values of a `Literal[...]` (or `Literal[...] | None`) field; None for any other type."""
    args = (
        [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else [annotation]
    )
    if not all(typing.get_origin(a) is typing.Literal for a in args):
        return None
    return tuple(value for a in args for value in typing.get_args(a))


def _extra(field: FieldInfo) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def env_name(settings: type[BaseSettings], name: str) -> str:
    return f"{settings.model_config.get('env_prefix', '')}{name}".upper()


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, settings: type[BaseSettings]
) -> None:
    """One flag per field; unset flags stay None, so the environment and the defaults apply."""
    for name, field in settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description} [env {env_name(settings, name)}; default: {default!r}]"
        extra = _extra(field)
        choices = _choices(field.annotation)
        metavar = extra.get("metavar") or (choices and "{" + ",".join(map(str, choices)) + "}")
        flags = (flag, *extra.get("aliases", ()))
        if _is_bool(field.annotation):
            parser.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif (
            _is_list(field.annotation) and extra.get("nargs") == "+"
        ):  # vLLM's `--lora-modules a=PATH b=PATH`
            parser.add_argument(
                *flags,
                action="extend",
                nargs="+",
                default=None,
                metavar=metavar or "VALUE",
                help=help_text + " (several after one flag, or repeat the flag)",
            )
        elif _is_list(field.annotation):
            parser.add_argument(
                *flags,
                action="append",
                default=None,
                metavar=metavar or "VALUE",
                help=help_text + " (repeat the flag or separate with commas)",
            )
        else:
            parser.add_argument(
                *flags, default=None, metavar=metavar or name.upper(), help=help_text
            )


def parse_settings(settings: type[BaseSettings], args: argparse.Namespace) -> Any:
    """Flags over environment variables over defaults; ValueError with a readable message."""
    given = {
        name: getattr(args, name)
        for name in settings.model_fields
        if getattr(args, name, None) is not None
    }
    try:
        return settings(**given)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            if err["loc"]:
                name = str(err["loc"][0])
                problems.append(
                    f"--{name.replace('_', '-')} / {env_name(settings, name)}: {err['msg']}"
                )
            else:  # a check over several fields (EngineArgs' own), its message names the option
                problems.append(err["msg"].removeprefix("Value error, "))
        raise ValueError("invalid configuration:\n  " + "\n  ".join(problems)) from None


def _default_text(field: FieldInfo) -> str:
    default = field.get_default(call_default_factory=True)
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None or default == []:
        return "–"  # unset: the meaning says what that does
    if _extra(field).get("unit") == "bytes":
        for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
            if default % size == 0:
                return f"{default // size}{unit}"
    return f"`{default:g}`" if isinstance(default, float) else f"`{default}`"


def flags_table(*settings_models: type[BaseSettings]) -> str:
    """A Markdown table of the flags `add_flags` makes for `settings_models` (docs/server.md and
    docs/scaling.md hold these, written by benchmarks/flag_docs.py)."""
    rows = ["| Flag | Env var | Default | Meaning |", "|---|---|---|---|"]
    for settings in settings_models:
        for name, field in settings.model_fields.items():
            flag, extra = "--" + name.replace("_", "-"), _extra(field)
            choices = _choices(field.annotation)
            if _is_bool(field.annotation):
                spelling = f"`{flag}` / `--no-{flag[2:]}`"
            else:
                metavar = extra.get("metavar") or (choices and "\\|".join(map(str, choices)))
                spelling = f"`{flag} {metavar}`" if metavar else f"`{flag}`"
            spelling += "".join(f" (or `{alias}`)" for alias in extra.get("aliases", ()))
            meaning = (field.description or "").replace("|", "\\|")
            if _is_list(field.annotation):
                meaning += " Repeat the flag or separate with commas."
            rows.append(
                f"| {spelling} | `{env_name(settings, name)}` | {_default_text(field)} | {meaning} |"
            )
    return "\n".join(rows) + "\n"
