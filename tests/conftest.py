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
