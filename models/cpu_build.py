"""Compiling models/csrc into the libraries models/cpu_ops.py loads, cached on disk.

Two plain C++ libraries, neither with torch or Python headers (so any torch shares them):
* the host library (models/csrc/host/): the ops' C API, the decoder stack, and loading a set;
* one kernel set per instruction set (models/csrc/<set>/, models/cpu_isa.py).
Each lives in the cache root (`$KVSERVE_CPU_OPS_DIR`, else `$KVSERVE_CACHE_DIR/cpu_ops`, else
`~/.cache/kvserve/cpu_ops`) in a folder named by a digest of its sources and flags; one already
there is used without a compiler (how the CPU Docker image ships them). A build runs every
translation unit of the libraries it needs as its own compiler process, all at once, then links
each library; the finished file is renamed into place, so concurrent builds lose nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvserve.models import cpu_isa

CSRC = Path(__file__).parent / "csrc"
HOST_DIR = CSRC / "host"
COMMON_FLAGS = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
# the host library only calls the set's kernels and runs the scalar fallbacks: -O2 is plenty
HOST_FLAGS = ["-O2", "-pthread", *COMMON_FLAGS]
SET_OPT = "-O3"


def cache_root() -> Path:
    root = os.environ.get("KVSERVE_CPU_OPS_DIR")
    if not root:
        root = (
            Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")
            / "cpu_ops"
        )
    return Path(root)


def digest(paths: list[Path], extra: str) -> str:
    """What names a library's folder: its sources' names and bytes, and its flags."""
    data = (
        b"".join(path.name.encode() + path.read_bytes() for path in sorted(paths)) + extra.encode()
    )
    return hashlib.sha256(data).hexdigest()[:16]


def _headers() -> list[Path]:
    return sorted(CSRC.glob("*.h"))


def host_sources() -> list[Path]:
    return sorted(HOST_DIR.glob("*.cpp"))


def host_library() -> Path:
    """Where the host library for these sources and flags lives."""
    sources = host_sources() + sorted(HOST_DIR.glob("*.h")) + _headers()
    return cache_root() / f"host-{digest(sources, ' '.join(HOST_FLAGS))}" / "kvserve_host.so"


def set_sources(isa: str) -> list[Path]:
    return sorted((CSRC / cpu_isa.source_dir(isa)).glob("*.cpp"))


def set_library(isa: str) -> Path:
    """Where kernel set `isa` for these sources and flags lives."""
    sources = set_sources(isa) + sorted((CSRC / cpu_isa.source_dir(isa)).glob("*.h")) + _headers()
    return (
        cache_root()
        / f"{isa}-{digest(sources, ' '.join(cpu_isa.COMPILE_FLAGS[isa]))}"
        / f"kvserve_kernels_{isa}.so"
    )


@dataclass(frozen=True, slots=True)
class Target:
    """One library to build: its translation units, compile flags and link flags."""

    name: str  # for messages: "host", "avx2", ...
    library: Path
    sources: list[Path]
    flags: list[str]
    link_flags: list[str]
    # the header every translation unit includes first, compiled once (a precompiled header:
    # parsing <immintrin.h> alone would cost each unit most of a second); None: none
    header: Path | None = None


def host_target() -> Target:
    libdl = (
        ["-ldl"] if platform.system() == "Linux" else []
    )  # dlopen (in libc itself from glibc 2.34)
    return Target("host", host_library(), host_sources(), HOST_FLAGS, ["-pthread", *libdl])


def set_target(isa: str) -> Target:
    return Target(
        isa,
        set_library(isa),
        set_sources(isa),
        [SET_OPT, *COMMON_FLAGS, *cpu_isa.COMPILE_FLAGS[isa]],
        [],
        CSRC / cpu_isa.source_dir(isa) / f"{cpu_isa.source_dir(isa)}.h",
    )


def build(targets: list[Target], compiler: str | None = None) -> list[Path | Exception]:
    """Each target's library (built unless cached), or the exception that stopped its build; every
    translation unit of every target to build compiles at once, in its own process. Processes
    building into one cache take turns (a file lock): the server's processes, starting together,
    compile once instead of each competing for the same cores."""
    if all(t.library.exists() for t in targets):
        return [t.library for t in targets]
    with _build_lock():
        return _build(targets, compiler or os.environ.get("CXX") or "c++")


@contextlib.contextmanager
def _build_lock():
    try:
        import fcntl

        cache_root().mkdir(parents=True, exist_ok=True)
        lock = open(cache_root() / ".build.lock", "w")  # held until the build ends
    except (ImportError, OSError):  # no fcntl (Windows) or an unwritable cache: build unlocked
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build(targets: list[Target], compiler: str) -> list[Path | Exception]:
    results: list[Path | Exception | None] = [
        t.library if t.library.exists() else None for t in targets
    ]
    pending = []
    try:
        for i, target in enumerate(targets):
            if results[i] is not None:
                continue
            try:
                target.library.parent.mkdir(parents=True, exist_ok=True)
                tmp = tempfile.TemporaryDirectory(dir=target.library.parent)
                pending.append((i, target, tmp, _compile(compiler, target, Path(tmp.name))))
            except OSError as exc:  # no compiler, an unwritable cache
                results[i] = exc
        for i, target, tmp, procs in pending:
            try:
                results[i] = _link(compiler, target, Path(tmp.name), procs)
            except Exception as exc:
                results[i] = exc
    finally:
        for _, _, tmp, procs in pending:
            for _, proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            tmp.cleanup()
    return results  # type: ignore[return-value]


def _compile(compiler: str, target: Target, tmp: Path) -> list[tuple[Path, subprocess.Popen]]:
    flags = [*target.flags, *_precompiled(compiler, target, tmp)]
    return [
        (
            tmp / f"{source.stem}.o",
            subprocess.Popen(
                [compiler, *flags, "-c", str(source), "-o", str(tmp / f"{source.stem}.o")],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=tmp,
            ),
        )
        for source in target.sources
    ]


def _precompiled(compiler: str, target: Target, tmp: Path) -> list[str]:
    """Flags that have each unit start from `target.header` precompiled into `tmp` (GCC's
    `-include` finds `tmp/NAME.gch` first, the compiler's working directory being `tmp`); none
    when that fails. A compiler that cannot use the file reads the header itself, from its folder."""
    header = target.header
    if header is None or not header.exists():
        return []
    built = subprocess.run(
        [
            compiler,
            *target.flags,
            "-x",
            "c++-header",
            str(header),
            "-o",
            str(tmp / f"{header.name}.gch"),
        ],
        capture_output=True,
    )
    return [] if built.returncode else ["-include", header.name, f"-I{header.parent}"]


def _link(
    compiler: str, target: Target, tmp: Path, procs: list[tuple[Path, subprocess.Popen]]
) -> Path:
    errors = [out for _, proc in procs for out in [proc.communicate()[0]] if proc.returncode]
    if errors:
        raise RuntimeError(f"building the {target.name} CPU library failed:\n{errors[0][-3000:]}")
    staged = tmp / target.library.name
    no_undefined = (
        ["-Wl,-z,defs"] if platform.system() == "Linux" else []
    )  # a missing symbol fails here
    link = subprocess.run(
        [
            compiler,
            "-shared",
            *no_undefined,
            *[str(o) for o, _ in procs],
            *target.link_flags,
            "-o",
            str(staged),
        ],
        capture_output=True,
        text=True,
    )
    if link.returncode:
        raise RuntimeError(
            f"linking the {target.name} CPU library failed:\n{link.stdout[-1500:]}{link.stderr[-1500:]}"
        )
    os.replace(staged, target.library)  # atomic: a concurrent build loses nothing
    return target.library


def build_set(isa: str, compiler: str | None = None) -> Path:
    """Kernel set `isa`'s library, compiled unless cached (a RuntimeError says why it cannot be)."""
    (result,) = build([set_target(isa)], compiler)
    if isinstance(result, Exception):
        raise result
    return result


def build_all() -> list[str]:
    """Build the host library and every kernel set of this machine's architecture, whatever this
    CPU runs (an image runs on other CPUs than its builder's) -> the sets built."""
    arch = cpu_isa.machine_arch()
    sets = (
        [isa for isa in cpu_isa.ISAS if (isa == "neon") == (arch == "arm64")]
        if arch in ("x86_64", "arm64")
        else []
    )
    for result in build([host_target(), *[set_target(isa) for isa in sets]]):
        if isinstance(result, Exception):
            raise result
    return sets
