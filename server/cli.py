"""`kvserve` command line: `serve` (the OpenAI-compatible server) and `bench` (the load tester).

Every `serve` flag is generated from a `ServerConfig` field, so each one also has a
`KVSERVE_*` environment variable; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvserve.server import package_version

if TYPE_CHECKING:
    import uvicorn

    from kvserve.server.config import ServerConfig

# ServerConfig and the flag builder are imported where they are used: the engine core is a
# spawned process that imports this module again, and it has no use for pydantic-settings.


def _add_serve_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    from kvserve.server.config import ServerConfig
    from kvserve.server.flags import add_flags

    add_flags(parser, ServerConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="kvserve: a small paged-KV-cache inference server with an OpenAI-compatible API.",
        epilog="Run `kvserve serve --help` for the server's flags.",
    )
    parser.add_argument("--version", action="version", version=f"kvserve {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,ray,bench}")
    serve = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /tokenize, /detokenize, /version). Every flag can also be "
        "set with the environment variable shown; flags win over the environment.",
    )
    _add_serve_flags(serve)
    sub.add_parser(
        "ray",
        help="serve N replicas on Ray Serve (`kvserve ray --help`; needs kvserve[ray])",
        add_help=False,
    )
    sub.add_parser(
        "bench", help="load-test a running server (`kvserve bench serve --help`)", add_help=False
    )
    return parser


def load_config(args: argparse.Namespace) -> ServerConfig:
    """Merge flags over `KVSERVE_*` env vars over defaults; ValueError with a readable message."""
    from kvserve.server.config import ServerConfig
    from kvserve.server.flags import parse_settings

    return parse_settings(ServerConfig, args)


# uvicorn.run's code for "the app failed to start"
EXIT_STARTUP_FAILURE = 3
EXIT_ENGINE_DIED = 1


def uvicorn_config(app: Any, config: ServerConfig) -> uvicorn.Config:
    """uvicorn's settings, with kvserve's connection defences (`server.connections`) as the HTTP protocol."""
    import uvicorn

    from kvserve.server.connections import (
        ConnectionLimits,
        default_max_connections,
        install_log_rate_limits,
        protocol_class,
    )

    limits = ConnectionLimits(
        header_timeout_s=config.header_timeout,
        stream_idle_timeout_s=config.stream_idle_timeout,
        max_connections=config.max_connections or default_max_connections(),
    )
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        http=protocol_class(limits),
        timeout_keep_alive=config.keep_alive_timeout,  # type: ignore[arg-type]  # a float works
        timeout_graceful_shutdown=5,
    )
    install_log_rate_limits()
    return uv_config


def serve(config: ServerConfig) -> int:
    """Run the server until SIGINT/SIGTERM (drain, then exit 0) or until the engine dies (exit 1)."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from kvserve.engine import AsyncLLM, EngineArgs

    # the engine core starts loading now, while this process imports the web stack
    engine = AsyncLLM(EngineArgs(**config.engine_kwargs()), wait=False)
    import uvicorn  # noqa: F401  (the web stack's import overlaps the engine core's start)

    from kvserve.server.app import create_app
    from kvserve.server.drain import DrainingServer

    app = create_app(config, engine=engine, owns_engine=True)
    server = DrainingServer(uvicorn_config(app, config), app, config.shutdown_timeout)
    app.state.request_exit = lambda: setattr(server, "should_exit", True)
    server.run()
    if not server.started:
        return EXIT_STARTUP_FAILURE
    if (
        getattr(app.state, "engine_failed", False) or engine.error is not None
    ):  # (also a death mid-drain)
        return EXIT_ENGINE_DIED
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from kvserve.loadtest.cli import main as bench_main

        return bench_main(argv[1:]) or 0
    if argv and argv[0] == "ray":
        from kvserve.server.ray_cli import main as ray_main

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
