import contextlib
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/checkpoints.py and helpers

# keep the default model (and anything else cached) out of the user's home
os.environ.setdefault("KVSERVE_CACHE_DIR", str(Path(__file__).parent.parent / ".kvserve_cache"))

from checkpoints import FAMILIES, make_checkpoint  # noqa: E402

CPUS = len(os.sched_getaffinity(0))


def _share_the_cores() -> None:
    """Under pytest-xdist each worker gets its share of the cores (and so do the servers, engine
    cores and tensor-parallel ranks it starts, through OMP_NUM_THREADS): workers whose thread
    pools each want every core wait on each other's preempted threads. Kernel tests still run
    with every core (`kernel_set`), so the kernels' work splitting is tested."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    threads = max(1, CPUS // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores()


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory) -> dict[str, str]:
    """One tiny random checkpoint per family, built once per test session."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: make_checkpoint(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def llama_dir(checkpoint_dirs) -> str:
    return checkpoint_dirs["llama"]


@contextlib.contextmanager
def every_core():
    """torch's thread pool (which the CPU kernels split their work over) at every core, for a while."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(CPUS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _kernel_sets() -> list[str]:
    """Every CPU kernel set this machine can run (KVSERVE_CPU_ISA narrows it to the one forced)."""
    from kvserve.models import cpu_isa

    forced = os.environ.get("KVSERVE_CPU_ISA", "").strip().lower()
    if forced not in ("", "auto"):
        return [forced]
    sets = cpu_isa.runnable()
    if "avx512" in sets:
        # avx512vnni is the avx512 sources built without BF16: where both run, the C++ driver
        # (tests/test_kernel_sets.py) checks its kernels, and these tests take the other two
        sets.remove("avx512vnni")
    return sets or ["none"]


@pytest.fixture(params=_kernel_sets())
def kernel_set(request):
    """Runs a test once per CPU kernel set this CPU can execute (avx512 and avx2 on an AVX512-BF16
    machine, avx512vnni and avx2 on an AVX-512 one without BF16), the ops switched to that set for
    its duration; skips where no set runs."""
    from kvserve.models import cpu_isa, cpu_ops

    if request.param == "none" or not cpu_ops.load():
        pytest.skip(
            "no CPU kernel set runs here: "
            + ", ".join(
                f"{isa} needs {' and '.join(cpu_isa.missing_flags(isa))}" for isa in cpu_isa.ISAS
            )
        )
    with every_core():
        previous = cpu_ops.use_isa(request.param)
        try:
            yield request.param
        finally:
            cpu_ops.use_isa(previous)


@pytest.fixture(params=[*[s for s in _kernel_sets() if s != "none"], "none"])
def kernel_set_or_none(request):
    """`kernel_set`, plus a run with no set loaded (the host library's plain loops)."""
    from kvserve.models import cpu_ops

    if not cpu_ops.load():
        pytest.skip("kvserve's CPU host library could not be built here")
    with every_core():
        previous = cpu_ops.use_isa(request.param)
        try:
            yield request.param
        finally:
            cpu_ops.use_isa(previous)
