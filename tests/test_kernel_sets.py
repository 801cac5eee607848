"""Each CPU kernel set (models/csrc/<set>/) against plain C++ references, without torch.

tests/csrc/kernel_check.cpp is compiled with one set's sources (the set's flags from
models/cpu_isa.COMPILE_FLAGS) and run on a serial and a 2-thread host: every kernel of the table
at the shape classes of tests/test_cpu_ops.py and tests/test_quantization.py, one line per check
(tolerances in the driver, next to each check). The host library's LoRA shrink/expand
(models/csrc/host/lora.cpp) is linked in too and run both ways it can run: with the set loaded (its
AVX2 tiles under the x86 sets, its plain loops under neon) and with none (the plain loops, which the
x86 machines of CI would otherwise never run). The x86 sets run natively where the CPU has their
instructions; the NEON set runs natively on an ARM64 CPU with the dot-product instructions, else
cross-compiled (aarch64-linux-gnu-g++, -static) under qemu-aarch64 with --quick (every shape
class, a third of the attention cases: the emulator is slow). Each test skips, saying why, where
its set's sources, the CPU's features or the tools are missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvserve.models import cpu_isa

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "models" / "csrc"
DRIVER = ROOT / "tests" / "csrc" / "kernel_check.cpp"
LORA = CSRC / "host" / "lora.cpp"  # the host library's LoRA kernels: AVX2 tiles or plain loops
BASE_FLAGS = [
    "-O2",
    "-std=c++17",
]  # -O2: the sets' kernels are intrinsics, -O3 only compiles longer
CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
TIMEOUT_S = 240


def _set_sources(isa: str) -> list[Path]:
    sources = sorted((CSRC / cpu_isa.source_dir(isa)).glob("*.cpp"))
    if not sources:
        pytest.skip(f"models/csrc/{isa}/ has no sources yet")
    return sources


def _build(compiler: str, isa: str, tmp_path: Path, link_flags: list[str]) -> Path:
    """The driver linked with set `isa`, each translation unit compiled in its own process."""
    flags = [*BASE_FLAGS, *cpu_isa.COMPILE_FLAGS[isa], f"-DKV_SET={isa}", f"-I{CSRC}"]
    objects, procs = [], []
    for source in [DRIVER, *_set_sources(isa), LORA]:
        obj = tmp_path / f"{source.parent.name}_{source.stem}.o"
        objects.append(obj)
        procs.append(
            (
                source,
                subprocess.Popen(
                    [compiler, *flags, "-c", str(source), "-o", str(obj)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
            )
        )
    errors = []
    for source, proc in procs:
        out = proc.communicate(timeout=TIMEOUT_S)[0]
        if proc.returncode:
            errors.append(f"{source.relative_to(ROOT)}:\n{out[-3000:]}")
    if errors:
        pytest.fail(f"compiling the {isa} set with the driver failed:\n" + "\n".join(errors))
    exe = tmp_path / f"kernel_check_{isa}"
    link = subprocess.run(
        [compiler, *link_flags, "-pthread", *map(str, objects), "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if link.returncode:  # e.g. a kernel the set's table names but no source defines
        pytest.fail(
            f"linking the {isa} set with the driver failed:\n{link.stdout[-3000:]}{link.stderr[-3000:]}"
        )
    return exe


def _run(cmd: list[str], isa: str, emulated: bool = False) -> None:
    result = subprocess.run([*cmd, "-q"], capture_output=True, text=True, timeout=TIMEOUT_S)
    report = result.stdout + result.stderr
    if result.returncode == 2 and "returned nullptr" in report:
        # natively, cpu_isa said this CPU runs the set: its entry point disagreeing is a bug
        if emulated:
            pytest.skip(f"{QEMU}'s CPU lacks the {isa} set's instructions (an older qemu?)")
        pytest.fail(
            f"cpu_isa.missing_flags({isa!r}) finds nothing missing, but the set refuses the CPU:\n{report}"
        )
    assert result.returncode == 0, f"the {isa} kernel set fails its checks:\n{report[-8000:]}"
    assert "0 failed" in report  # the summary line: the driver ran to the end


def _compiler() -> str:
    return os.environ.get("CXX") or "c++"


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni", "avx512"])
def test_x86_set_matches_the_references(isa, tmp_path):
    if cpu_isa.machine_arch() != "x86_64":
        pytest.skip(f"the {isa} set needs an x86-64 CPU, this is {cpu_isa.machine_arch()}")
    missing = cpu_isa.missing_flags(isa)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} (the {isa} set's instructions)")
    _set_sources(isa)
    if not shutil.which(_compiler()):
        pytest.skip(f"no C++ compiler ({_compiler()})")
    _run([str(_build(_compiler(), isa, tmp_path, []))], isa)


def test_neon_set_matches_the_references(tmp_path):
    _set_sources("neon")
    if (
        cpu_isa.machine_arch() == "arm64"
    ):  # natively, where the CPU has the dot-product instructions
        missing = cpu_isa.missing_flags("neon")
        if missing:
            pytest.skip(f"this CPU lacks {', '.join(missing)} (the neon set's instructions)")
        if not shutil.which(_compiler()):
            pytest.skip(f"no C++ compiler ({_compiler()})")
        _run([str(_build(_compiler(), "neon", tmp_path, []))], "neon")
        return
    for tool, package in ((CROSS_CXX, "g++-aarch64-linux-gnu"), (QEMU, "qemu-user")):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not installed (Debian/Ubuntu: apt-get install {package})")
    exe = _build(CROSS_CXX, "neon", tmp_path, ["-static"])
    _run([QEMU, str(exe), "--quick"], "neon", emulated=True)
