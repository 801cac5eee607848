"""The installed distribution is one import package, `kvserve`, so a user's own `models.py`,
`server.py` or `engine/` can never shadow it (or be shadowed by it)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    return next(out.glob("kvserve-*.whl"))


def test_the_wheel_installs_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "kvserve"
    }
    assert "kvserve/__init__.py" in names and "kvserve/models/csrc/host/ops.cpp" in names
    assert not any(
        n.startswith(("kvserve/tests/", "kvserve/benchmarks/", "kvserve/docs/")) for n in names
    )
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvserve = kvserve.server.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_kvserve_imports_beside_a_users_models_server_and_engine(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    user = tmp_path / "project"
    (user / "engine").mkdir(parents=True)
    for name in ("models.py", "server.py", "engine/__init__.py"):
        (user / name).write_text(
            "raise SystemExit('the user module was imported instead of kvserve')\n"
        )
    script = (
        "import kvserve, kvserve.engine.core.scheduler, kvserve.server.config\n"
        "from kvserve import LLM, SamplingParams, AsyncLLM, EngineArgs\n"
        f"assert kvserve.__file__.startswith({str(site)!r}), kvserve.__file__\n"
        "print(LLM.__module__)\n"
    )
    # the script's own folder comes first on sys.path, as for any user script; the wheel's target
    # dir stands in for site-packages (the editable checkout must not be what is found)
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path[:0] = ['', {str(site)!r}]\n" + script],
        cwd=user,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "kvserve.engine.llm"
