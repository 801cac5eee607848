import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/checkpoints.py and helpers

# keep the default model (and anything else cached) out of the user's home
os.environ.setdefault("KVSERVE_CACHE_DIR", str(Path(__file__).parent.parent / ".kvserve_cache"))

from checkpoints import FAMILIES, make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory) -> dict[str, str]:
    """One tiny random checkpoint per family, built once per test session."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: make_checkpoint(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def llama_dir(checkpoint_dirs) -> str:
    return checkpoint_dirs["llama"]


def _kernel_sets() -> list[str]:
    """Every CPU kernel set this machine can run (KVSERVE_CPU_ISA narrows it to the one forced)."""
    from kvserve.models import cpu_isa

    forced = os.environ.get("KVSERVE_CPU_ISA", "").strip().lower()
    if forced not in ("", "auto"):
        return [forced]
    return cpu_isa.runnable() or ["none"]


@pytest.fixture(params=_kernel_sets())
def kernel_set(request):
    """Runs a test once per CPU kernel set this CPU can execute (avx512 and avx2 on an AVX512-BF16
    machine), the ops switched to that set for its duration; skips where no set runs."""
    from kvserve.models import cpu_ops, cpu_isa

    if request.param == "none" or not cpu_ops.load():
        pytest.skip("no CPU kernel set runs here: " + ", ".join(
            f"{isa} needs {' and '.join(cpu_isa.missing_flags(isa))}" for isa in cpu_isa.ISAS))
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
    previous = cpu_ops.use_isa(request.param)
    try:
        yield request.param
    finally:
        cpu_ops.use_isa(previous)
