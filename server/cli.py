"""`kvserve` command line: `serve` (the OpenAI-compatible server) and `bench` (the load tester).

Every `serve` flag is generated from a `ServerConfig` field, so each one also has a
`KVSERVE_*` environment variable; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import ValidationError

from server import package_version
from server.config import ENV_PREFIX, ServerConfig

if TYPE_CHECKING:
    import uvicorn

_METAVARS = {"kv_cache_memory": "BYTES", "max_body_bytes": "BYTES", "chat_template": "PATH_OR_STR",
             "model": "PATH_OR_ID", "tokenizer": "PATH_OR_ID", "api_key": "KEY", "cors_origin": "ORIGIN",
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


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in ServerConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description} [env {ENV_PREFIX}{name.upper()}; default: {default!r}]"
        if _is_bool(field.annotation):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif _is_list(field.annotation):
            parser.add_argument(flag, action="append", default=None, metavar=_METAVARS.get(name, "VALUE"),
                                help=help_text + " (repeat the flag or separate with commas)")
        else:
            parser.add_argument(flag, default=None, metavar=_METAVARS.get(name, name.upper()), help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="kvserve: a small paged-KV-cache inference server with an OpenAI-compatible API.",
        epilog="Run `kvserve serve --help` for the server's flags.",
    )
    parser.add_argument("--version", action="version", version=f"kvserve {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,ray,bench}")
    serve = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics, /tokenize, /detokenize, /version). Every flag can also be "
                    f"set with the environment variable shown; flags win over the environment.",
    )
    _add_serve_flags(serve)
    sub.add_parser("ray", help="serve N replicas on Ray Serve (`kvserve ray --help`; needs kvserve[ray])",
                   add_help=False)
    sub.add_parser("bench", help="load-test a running server (`kvserve bench serve --help`)", add_help=False)
    return parser


def load_config(args: argparse.Namespace) -> ServerConfig:
    """Merge flags over `KVSERVE_*` env vars over defaults; ValueError with a readable message."""
    given = {name: getattr(args, name) for name in ServerConfig.model_fields if getattr(args, name) is not None}
    try:
        return ServerConfig(**given)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "?"
            if not err["loc"]:   # a check across fields: its message names the flags
                problems.append(str(err["msg"]).removeprefix("Value error, "))
                continue
            problems.append(f"--{name.replace('_', '-')} / {ENV_PREFIX}{name.upper()}: {err['msg']}")
        raise ValueError("invalid configuration:\n  " + "\n  ".join(problems)) from None


# uvicorn.run's code for "the app failed to start"
EXIT_STARTUP_FAILURE = 3
EXIT_ENGINE_DIED = 1


def uvicorn_config(app: object, config: ServerConfig) -> uvicorn.Config:
    """uvicorn's settings, with kvserve's connection defences (`server.connections`) as the HTTP protocol."""
    import uvicorn

    from server.connections import ConnectionLimits, default_max_connections, install_log_rate_limits, protocol_class

    limits = ConnectionLimits(header_timeout_s=config.header_timeout, stream_idle_timeout_s=config.stream_idle_timeout,
                              max_connections=config.max_connections or default_max_connections())
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               http=protocol_class(limits), timeout_keep_alive=config.keep_alive_timeout,
                               timeout_graceful_shutdown=5)
    install_log_rate_limits()
    return uv_config


def serve(config: ServerConfig) -> int:
    """Run the server until SIGINT/SIGTERM (drain, then exit 0) or until the engine dies (exit 1)."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine import AsyncLLM, EngineArgs

    # the engine core starts loading now, while this process imports the web stack
    engine = AsyncLLM(EngineArgs(**config.engine_kwargs()), wait=False,
                      max_consecutive_step_failures=config.max_consecutive_step_failures)
    import uvicorn

    from server.app import create_app
    from server.drain import DrainingServer

    app = create_app(config, engine=engine, owns_engine=True)
    server = DrainingServer(uvicorn_config(app, config), app, config.shutdown_timeout)
    app.state.request_exit = lambda: setattr(server, "should_exit", True)
    server.run()
    if not server.started:
        return EXIT_STARTUP_FAILURE
    if getattr(app.state, "engine_failed", False) or engine.error is not None:  # (also a death mid-drain)
        return EXIT_ENGINE_DIED
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from loadtest.cli import main as bench_main

        return bench_main(argv[1:]) or 0
    if argv and argv[0] == "ray":
        from server.ray_cli import main as ray_main

        return ray_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help()
        return 2
    try:
        config = load_config(args)
        return serve(config)
    except ValueError as exc:  # a bad setting (the engine validates its own before starting)
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
