"""Command-line flags generated from a pydantic settings model: one flag per field, named after it
(`max_num_seqs` -> `--max-num-seqs`), with its description, default and environment variable in
the help. `kvserve serve` and `kvserve ray` both build their parsers here, so an option written
once (on `EngineArgs`, `ServerConfig` or `RayOptions`) reads the same everywhere."""

from __future__ import annotations

import argparse
import types
import typing

from pydantic import ValidationError
from pydantic_settings import BaseSettings

# server fields whose value deserves a clearer placeholder than the field's name
_METAVARS = {"max_body_bytes": "BYTES", "chat_template": "PATH_OR_STR", "api_key": "KEY", "cors_origin": "ORIGIN",
             "served_model_name": "NAME"}


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


def env_name(settings: type[BaseSettings], name: str) -> str:
    return f"{settings.model_config.get('env_prefix', '')}{name}".upper()


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, settings: type[BaseSettings]) -> None:
    """One flag per field; unset flags stay None, so the environment and the defaults apply."""
    for name, field in settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description} [env {env_name(settings, name)}; default: {default!r}]"
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        metavar = extra.get("metavar") or _METAVARS.get(name)
        flags = (flag, *extra.get("aliases", ()))
        if _is_bool(field.annotation):
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif _is_list(field.annotation) and extra.get("nargs") == "+":  # vLLM's `--lora-modules a=PATH b=PATH`
            parser.add_argument(*flags, action="extend", nargs="+", default=None, metavar=metavar or "VALUE",
                                help=help_text + " (several after one flag, or repeat the flag)")
        elif _is_list(field.annotation):
            parser.add_argument(*flags, action="append", default=None, metavar=metavar or "VALUE",
                                help=help_text + " (repeat the flag or separate with commas)")
        else:
            parser.add_argument(*flags, default=None, metavar=metavar or name.upper(), help=help_text)


def parse_settings(settings: type[BaseSettings], args: argparse.Namespace):
    """Flags over environment variables over defaults; ValueError with a readable message."""
    given = {name: getattr(args, name) for name in settings.model_fields if getattr(args, name, None) is not None}
    try:
        return settings(**given)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            if err["loc"]:
                name = str(err["loc"][0])
                problems.append(f"--{name.replace('_', '-')} / {env_name(settings, name)}: {err['msg']}")
            else:  # a check over several fields (EngineArgs' own), its message names the option
                problems.append(err["msg"].removeprefix("Value error, "))
        raise ValueError("invalid configuration:\n  " + "\n  ".join(problems)) from None
