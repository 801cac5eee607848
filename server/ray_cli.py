"""`kvserve ray`: the OpenAI server as N replicas on Ray Serve (needs `pip install kvserve[ray]`).

Takes every `kvserve serve` flag (the model and each replica's engine and server settings;
--host/--port become Ray Serve's HTTP proxy address) plus the replica flags below. Runs until
SIGINT/SIGTERM, then removes the application (and stops the Ray cluster it started, if any).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from server.cli import _add_serve_flags, load_config
from server.config import ServerConfig

if TYPE_CHECKING:
    from server.ray_serve import RayServeOptions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve ray",
        description="Serve a model as N replicas on Ray Serve behind one OpenAI-compatible endpoint, with "
                    "prefix-affinity routing (docs/scaling.md). Takes every `kvserve serve` flag too.")
    ray_group = parser.add_argument_group("replicas (Ray Serve)")
    ray_group.add_argument("--replicas", type=int, default=1, help="replicas to start (default 1)")
    ray_group.add_argument("--min-replicas", type=int, default=None,
                           help="autoscale: fewest replicas (setting this or --max-replicas turns autoscaling on)")
    ray_group.add_argument("--max-replicas", type=int, default=None, help="autoscale: most replicas")
    ray_group.add_argument("--target-ongoing-requests", type=float, default=None,
                           help="autoscale: requests per replica the autoscaler aims at (default max-num-seqs / 4)")
    ray_group.add_argument("--routing", choices=("prefix", "pow2"), default="prefix",
                           help="prefix: requests sharing a prompt prefix go to the same replica unless it is busy; "
                                "pow2: Ray Serve's power-of-two-choices (default prefix)")
    ray_group.add_argument("--max-imbalance", type=int, default=32,
                           help="prefix routing: a replica whose queue is longer than the shortest one's by more "
                                "than this is busy, and the request goes to the least-loaded replica (default 32)")
    ray_group.add_argument("--num-cpus-per-replica", type=float, default=1.0,
                           help="CPUs Ray reserves per replica; on CPU also its torch threads (default 1)")
    ray_group.add_argument("--num-gpus-per-replica", type=float, default=None,
                           help="GPUs per replica (default: the tensor-parallel size on CUDA, 0 on CPU)")
    ray_group.add_argument("--max-ongoing-requests", type=int, default=None,
                           help="requests one replica takes at once; more wait in Serve (default --max-num-seqs)")
    ray_group.add_argument("--ingress-replicas", type=int, default=1,
                           help="replicas of the thin HTTP ingress that routes (default 1)")
    ray_group.add_argument("--ray-address", default="local",
                           help="local: start a Ray cluster in this process; auto: join the one `ray start` "
                                "runs here; or a Ray address (default local)")
    ray_group.add_argument("--ray-num-cpus", type=int, default=None,
                           help="local cluster: CPUs it offers (default: this machine's)")
    _add_serve_flags(parser.add_argument_group("server and engine (as `kvserve serve`)"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args)
        from server.ray_serve import RayServeOptions

        options = RayServeOptions(
            num_replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests, routing=args.routing,
            max_imbalance=args.max_imbalance, num_cpus_per_replica=args.num_cpus_per_replica,
            num_gpus_per_replica=args.num_gpus_per_replica, max_ongoing_requests=args.max_ongoing_requests,
            num_ingress_replicas=args.ingress_replicas)
    except ValueError as exc:
        print(f"kvserve ray: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"kvserve ray: error: {exc}; install Ray Serve with `pip install kvserve[ray]`", file=sys.stderr)
        return 2
    return run(config, options, args.ray_address, args.ray_num_cpus)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run(config: ServerConfig, options: RayServeOptions, ray_address: str, ray_num_cpus: int | None) -> int:
    """Deploy, then block until SIGINT/SIGTERM; 0 after a clean stop, 3 if the deployment failed."""
    import ray
    from ray import serve

    from server.ray_serve import build_app

    is_local = ray_address == "local"
    if is_local:
        ray.init(num_cpus=ray_num_cpus or os.cpu_count(), include_dashboard=False)
    else:
        ray.init(address=ray_address)
    for signum in (signal.SIGINT, signal.SIGTERM):   # (SIGINT too: a shell's background job ignores it)
        signal.signal(signum, _interrupt)
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_app(config, options), name=options.app_name, route_prefix="/")
        print(f"kvserve: {options.num_replicas} replica(s) on Ray Serve at http://{config.host}:{config.port}/v1",
              flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:        # the application failed to deploy
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
