"""How kvserve runs on Ray Serve, without importing Ray: the options `kvserve ray` and
`app_builder` read (written once, as `RayServeOptions`' fields; their flags and
`KVSERVE_RAY_*` variables are generated from it) and where the Ray cluster is."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.config import check_choices, option
from kvserve.server.config import settings_model

RAY_ENV_PREFIX = "KVSERVE_RAY_"
ROUTING_POLICIES = ("prefix", "pow2")


@dataclass(frozen=True, slots=True)
class RayServeOptions:
    """How kvserve runs on Ray Serve (the model and server settings stay in `ServerConfig`).

    Autoscaling is on when `min_replicas` or `max_replicas` is set: Ray Serve's autoscaler keeps
    about `target_ongoing_requests` requests per replica, between the bounds, starting at
    `num_replicas`. `num_gpus_per_replica` None: the tensor-parallel size on CUDA, 0 on CPU.
    """

    num_replicas: int = option(
        1, "Replicas to start (with autoscaling: the initial count).", aliases=("--replicas",)
    )
    min_replicas: int | None = option(
        None, "Autoscale: fewest replicas (setting this or --max-replicas turns autoscaling on)."
    )
    max_replicas: int | None = option(None, "Autoscale: most replicas.")
    target_ongoing_requests: float | None = option(
        None,
        "Autoscale: requests per replica the autoscaler aims at, the queue depth it scales on (default "
        "max-num-seqs / 4).",
    )
    routing: str = option(
        "prefix",
        "prefix: requests sharing a prompt prefix go to the same replica unless it is busy; pow2: Ray "
        "Serve's power-of-two-choices.",
        choices=ROUTING_POLICIES,
    )
    max_imbalance: int = option(
        32,
        "Prefix routing: a replica whose queue is longer than the shortest one's by more than this is busy, "
        "and the request goes to the least-loaded replica (measured: docs/performance.md).",
    )
    num_cpus_per_replica: float = option(
        1.0, "CPUs Ray reserves per replica; on CPU also its torch threads (OMP_NUM_THREADS)."
    )
    num_gpus_per_replica: float | None = option(
        None,
        "GPUs per replica (default: the tensor-parallel size on CUDA, 0 on CPU; --device auto counts as CUDA "
        "when the cluster has GPUs).",
    )
    max_ongoing_requests: int | None = option(
        None, "Requests one replica takes at once; more wait in Serve (default --max-num-seqs)."
    )
    num_ingress_replicas: int = option(
        1, "Replicas of the thin HTTP ingress that routes.", aliases=("--ingress-replicas",)
    )
    app_name: str = option("kvserve", "Name of the Ray Serve application.")

    def __post_init__(self) -> None:
        check_choices(self)
        if self.num_replicas < 1 or self.num_ingress_replicas < 1:
            raise ValueError(
                f"need at least one replica, got num_replicas={self.num_replicas}, "
                f"num_ingress_replicas={self.num_ingress_replicas}"
            )
        low, high = self.min_replicas, self.max_replicas
        if (
            (low is not None and low < 0)
            or (high is not None and high < 1)
            or (low is not None and high is not None and low > high)
        ):
            raise ValueError(f"invalid autoscaling bounds min_replicas={low}, max_replicas={high}")
        if (
            self.max_imbalance < 0
            or self.num_cpus_per_replica < 0
            or (self.num_gpus_per_replica or 0) < 0
        ):
            raise ValueError(
                f"negative max_imbalance={self.max_imbalance}, num_cpus_per_replica="
                f"{self.num_cpus_per_replica} or num_gpus_per_replica={self.num_gpus_per_replica}"
            )
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise ValueError(
                f"target_ongoing_requests must be positive, got {self.target_ongoing_requests}"
            )

    @property
    def is_autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None


@dataclass(frozen=True, slots=True)
class RayCluster:
    """Where the replicas run."""

    ray_address: str = option(
        "local",
        "local: start a Ray cluster in this process; auto: join the one `ray start` runs here; or a Ray "
        "address.",
    )
    ray_num_cpus: int | None = option(
        None, "Local cluster: CPUs it offers (default: this machine's)."
    )


RayOptions = settings_model("RayOptions", RayServeOptions, RAY_ENV_PREFIX)
RayClusterOptions = settings_model("RayClusterOptions", RayCluster, RAY_ENV_PREFIX)
