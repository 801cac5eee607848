"""`kvserve ray`: the OpenAI server as N replicas on Ray Serve (needs `pip install kvserve[ray]`).

Takes every `kvserve serve` flag (the model and each replica's engine and server settings;
--host/--port become Ray Serve's HTTP proxy address) plus the replica flags below. Runs until
SIGINT/SIGTERM, then removes the application (and stops the Ray cluster it started, if any).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Sequence

from kvserve.server.config import ServerConfig
from kvserve.server.flags import add_flags, parse_settings
from kvserve.server.ray_options import RayClusterOptions, RayOptions, RayServeOptions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve ray",
        description="Serve a model as N replicas on Ray Serve behind one OpenAI-compatible endpoint, with "
        "prefix-affinity routing (docs/scaling.md). Takes every `kvserve serve` flag too.",
    )
    add_flags(parser.add_argument_group("replicas (Ray Serve)"), RayOptions)
    add_flags(parser.add_argument_group("Ray cluster"), RayClusterOptions)
    add_flags(parser.add_argument_group("server and engine (as `kvserve serve`)"), ServerConfig)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = parse_settings(ServerConfig, args)
        options = parse_settings(RayOptions, args).to_dataclass()
        cluster = parse_settings(RayClusterOptions, args)
    except ValueError as exc:
        print(f"kvserve ray: error: {exc}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("ray") is None:
        print(
            "kvserve ray: error: Ray is not installed; install Ray Serve with `pip install kvserve[ray]`",
            file=sys.stderr,
        )
        return 2
    return run(config, options, cluster.ray_address, cluster.ray_num_cpus)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run(
    config: ServerConfig, options: RayServeOptions, ray_address: str, ray_num_cpus: int | None
) -> int:
    """Deploy, then block until SIGINT/SIGTERM; 0 after a clean stop, 3 if the deployment failed."""
    import ray
    from ray import serve

    from kvserve.server.ray_serve import build_app

    is_local = ray_address == "local"
    if is_local:
        ray.init(num_cpus=ray_num_cpus or os.cpu_count(), include_dashboard=False)
    else:
        ray.init(address=ray_address)
    for signum in (
        signal.SIGINT,
        signal.SIGTERM,
    ):  # (SIGINT too: a shell's background job ignores it)
        signal.signal(signum, _interrupt)
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_app(config, options), name=options.app_name, route_prefix="/")
        print(
            f"kvserve: {options.num_replicas} replica(s) on Ray Serve at http://{config.host}:{config.port}/v1",
            flush=True,
        )
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:  # the application failed to deploy
        print(f"kvserve ray: error: {exc}", file=sys.stderr)
        return 3
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if is_local:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(options.app_name)
