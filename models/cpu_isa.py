"""Which CPU kernel set (models/csrc/<set>/) this machine runs, decided once at load.

Sets, widest first: `avx512` (AVX512-BF16 and VNNI; AMX tiles where present), `avx512vnni` (the
same sources built without BF16, for AVX-512 CPUs with VNNI only: Cascade Lake, Ice Lake),
`avx2` (AVX2, FMA and F16C: every x86-64 CPU of the last decade), `neon` (ARM64 with the
dot-product instructions: Graviton 2+, Ampere, Apple silicon).
`KVSERVE_CPU_ISA=avx512|avx512vnni|avx2|neon|none` forces one (`none`: PyTorch's ops only), e.g.
to run the AVX2 kernels on an AVX-512 machine.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

ISAS = ("avx512", "avx512vnni", "avx2", "neon")

# The folder of models/csrc/ each set is built from (where it is not the set's own name).
SOURCE_DIRS = {"avx512vnni": "avx512"}

# What each set is compiled with (models/cpu_ops.py) and what the CPU must have to run it
# (Linux's /proc/cpuinfo names).
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]  # every AVX-512 build's subsets
COMPILE_FLAGS = {
    "avx512": [
        *_AVX512,
        "-mavx512bf16",
        "-mavx512vnni",
        "-mfma",
        "-mf16c",
        "-mamx-tile",
        "-mamx-bf16",
    ],
    "avx512vnni": [*_AVX512, "-mavx512vnni", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "neon": ["-march=armv8.2-a+dotprod"],
}
_AVX512_CPU = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
REQUIRED_FLAGS = {
    "avx512": (*_AVX512_CPU, "avx512_bf16", "avx512_vnni", "fma", "f16c"),
    "avx512vnni": (*_AVX512_CPU, "avx512_vnni", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "neon": ("asimd", "asimddp"),
}


def source_dir(isa: str) -> str:
    """The folder of models/csrc/ whose sources build set `isa`."""
    return SOURCE_DIRS.get(isa, isa)


def machine_arch() -> str:
    """ "x86_64", "arm64" or what `platform.machine()` says."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return "x86_64"
    if machine in ("aarch64", "arm64"):
        return "arm64"
    return machine


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as Linux names them (x86 `flags`, ARM `Features`); empty elsewhere."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def missing_flags(
    isa: str, flags: frozenset[str] | None = None, arch: str | None = None
) -> list[str]:
    """The CPU features `isa` needs that this machine lacks (empty: it runs here)."""
    arch = arch or machine_arch()
    if (isa == "neon") != (arch == "arm64") or arch not in ("x86_64", "arm64"):
        return [f"an {'ARM64' if isa == 'neon' else 'x86-64'} CPU"]
    if isa == "neon" and platform.system() == "Darwin":
        return []  # every Apple silicon CPU has the dot-product instructions
    flags = cpu_flags() if flags is None else flags
    return [flag for flag in REQUIRED_FLAGS[isa] if flag not in flags]


def runnable() -> list[str]:
    """The sets this CPU can run, widest first."""
    return [isa for isa in ISAS if not missing_flags(isa)]


def chosen() -> str:
    """The set to load: `KVSERVE_CPU_ISA` when given (a set this CPU lacks is a ValueError), else the
    widest one this CPU runs, else "none"."""
    forced = os.environ.get("KVSERVE_CPU_ISA", "").strip().lower()
    if forced in ("", "auto"):
        sets = runnable()
        return sets[0] if sets else "none"
    if forced == "none":
        return "none"
    if forced not in ISAS:
        raise ValueError(
            f"KVSERVE_CPU_ISA={forced!r}: expected one of {', '.join(ISAS)}, none or auto"
        )
    missing = missing_flags(forced)
    if missing:
        raise ValueError(f"KVSERVE_CPU_ISA={forced!r}: this CPU lacks {', '.join(missing)}")
    return forced
