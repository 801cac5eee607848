"""kvserve's CPU kernels (models/csrc), built on first use with the local compiler.

Two libraries, each built once into a cache directory (`$KVSERVE_CPU_OPS_DIR`, else
`$KVSERVE_CACHE_DIR/cpu_ops`, else `~/.cache/kvserve/cpu_ops`; one already built there is loaded
without a compiler, which is how the CPU Docker image ships them):
* the torch binding (ops.cpp, decoder_stack.cpp): `torch.ops.kvserve.*`, argument checks and the
  ISA-independent ops;
* the kernel set this CPU runs (models/cpu_isa.py: avx512, avx2 or neon; `KVSERVE_CPU_ISA`
  forces one): plain C++ compiled for its instructions, one translation unit per kernel family,
  all compiled in parallel with the binding.
Anything that goes wrong (no compiler, `KVSERVE_CPU_KERNELS=0`) is logged once and the model keeps
its portable PyTorch path, so the kernels are an optimization, never a requirement.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

from kvserve.models import cpu_isa

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
BINDING_SOURCES = ("ops.cpp", "decoder_stack.cpp")
_NAME = "kvserve_cpu_ops"
_isa = "none"  # the loaded kernel set


def _put_ninja_on_path() -> None:
    """torch's extension builder runs `ninja`; the pip package's binary may not be on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _cache_root() -> Path:
    root = os.environ.get("KVSERVE_CPU_OPS_DIR")
    if not root:
        root = Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve") / "cpu_ops"
    return Path(root)


def _digest(paths: list[Path], extra: str) -> str:
    data = b"".join(path.name.encode() + path.read_bytes() for path in sorted(paths)) + extra.encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _headers() -> list[Path]:
    return sorted(CSRC.glob("*.h"))


def binding_dir() -> Path:
    """Where the binding for these sources and this torch lives."""
    sources = [CSRC / name for name in BINDING_SOURCES] + _headers()
    return _cache_root() / _digest(sources, torch.__version__)


def set_sources(isa: str) -> list[Path]:
    return sorted((CSRC / isa).glob("*.cpp"))


def set_library(isa: str) -> Path:
    """Where kernel set `isa` for these sources and flags lives (no torch in it: any torch shares it)."""
    sources = set_sources(isa) + sorted((CSRC / isa).glob("*.h")) + _headers()
    return _cache_root() / f"{isa}-{_digest(sources, ' '.join(cpu_isa.COMPILE_FLAGS[isa]))}" / f"kvserve_kernels_{isa}.so"


def build_set(isa: str, compiler: str | None = None) -> Path:
    """Compile kernel set `isa` (one process per translation unit, in parallel) unless built."""
    library = set_library(isa)
    if library.exists():
        return library
    compiler = compiler or os.environ.get("CXX") or "c++"
    flags = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
             *cpu_isa.COMPILE_FLAGS[isa]]
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        objects, procs = [], []
        for source in set_sources(isa):
            obj = Path(tmp) / (source.stem + ".o")
            objects.append(obj)
            procs.append(subprocess.Popen([compiler, *flags, "-c", str(source), "-o", str(obj)],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        errors = [out for proc in procs for out in [proc.communicate()[0]] if proc.returncode]
        if errors:
            raise RuntimeError(f"building the {isa} CPU kernels failed:\n{errors[0][-3000:]}")
        staged = Path(tmp) / library.name
        no_undefined = ["-Wl,-z,defs"] if platform.system() == "Linux" else []  # a missing kernel fails here
        link = subprocess.run([compiler, "-shared", *no_undefined, *[str(o) for o in objects], "-o", str(staged)],
                              capture_output=True, text=True)
        if link.returncode:
            raise RuntimeError(f"linking the {isa} CPU kernels failed:\n{link.stdout[-1500:]}{link.stderr[-1500:]}")
        os.replace(staged, library)  # atomic: a concurrent build loses nothing
    return library


def _build_binding() -> Path:
    # -O1: parsing torch's headers is most of its compile, and nothing in it is hot (the kernels
    # are the set's); -O2 would add a few seconds to the first start for nothing measurable
    build_dir = binding_dir()
    library = build_dir / f"{_NAME}.so"
    if library.exists():
        return library
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=_NAME, sources=[str(CSRC / name) for name in BINDING_SOURCES],
                       build_directory=str(build_dir), extra_cflags=["-O1", "-fopenmp"], extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)
    return library


def build(isa: str) -> tuple[Path | Exception, Path | Exception | None]:
    """Build (or find) the binding and set `isa` ("none": no set) side by side -> each one's
    library, or the exception that stopped its build."""
    def attempt(fn, *args) -> Path | Exception:
        try:
            return fn(*args)
        except Exception as exc:  # no compiler, headers or ninja
            return exc

    result: list[Path | Exception | None] = [None]
    worker = None
    if isa != "none":
        worker = threading.Thread(target=lambda: result.__setitem__(0, attempt(build_set, isa)))
        worker.start()
    binding = attempt(_build_binding)
    if worker:
        worker.join()
    return binding, result[0]


def build_all() -> list[str]:
    """Build the binding and every kernel set of this machine's architecture, whatever this CPU
    runs (an image runs on other CPUs than its builder's) -> the sets built."""
    arch = cpu_isa.machine_arch()
    sets = [isa for isa in cpu_isa.ISAS if (isa == "neon") == (arch == "arm64")] if arch in ("x86_64", "arm64") else []
    _build_binding()
    for isa in sets:
        build_set(isa)
    return sets


def _warn_unavailable(what: str, exc: Exception) -> None:
    errors = [line for line in str(exc).splitlines() if "error" in line.lower()]
    logger.warning("%s unavailable, using the PyTorch path: %s", what,
                   " | ".join(errors[:3])[:600] or str(exc)[:300])


@functools.cache
def load() -> bool:
    """Build (or reuse) and register the binding and the chosen kernel set; True when
    `torch.ops.kvserve` is usable (`isa()` says which set, "none" for none).
    `KVSERVE_CPU_AMX=0` keeps the bf16 linear off AMX tiles (`set_amx`)."""
    global _isa
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return False
    binding, library = build(cpu_isa.chosen())
    if isinstance(binding, Exception):
        _warn_unavailable("CPU kernels", binding)
        return False
    torch.ops.load_library(str(binding))
    if isinstance(library, Exception):
        _warn_unavailable("CPU kernel set", library)
    elif library is not None:
        try:
            _isa = torch.ops.kvserve.load_kernel_set(str(library), library.stem.removeprefix("kvserve_kernels_"))
        except RuntimeError as exc:
            _warn_unavailable("CPU kernel set", exc)
    logger.info("CPU kernels: %s", _isa)
    if os.environ.get("KVSERVE_CPU_AMX", "1") == "0":
        set_amx(False)
    return True


def isa() -> str:
    """The kernel set the ops call: "avx512", "avx2", "neon", or "none" (PyTorch's ops only)."""
    return _isa if load() else "none"


def use_isa(name: str) -> str:
    """Switch the ops to kernel set `name` ("none": no set), building it if needed; -> the previous
    one. For tests and benchmarks (every set has the same weight layouts); a server decides once."""
    global _isa
    previous = isa()
    if not load():
        raise RuntimeError("the CPU kernels could not be built here")
    missing = cpu_isa.missing_flags(name) if name != "none" else []
    if missing:
        raise ValueError(f"kernel set {name!r} cannot run here: this CPU lacks {', '.join(missing)}")
    if name == "none":
        torch.ops.kvserve.unload_kernel_set()
    else:
        torch.ops.kvserve.load_kernel_set(str(build_set(name)), name)
    _isa = name
    return previous


def set_amx(enabled: bool) -> bool:
    """Whether the bf16 linear multiplies 8 rows and more in AMX tiles on CPUs that have them (on by
    default); -> the previous setting. Off, every row's result is the same bits at any batch size
    (the tiles' fp32 sums differ from the AVX512 path's in the last bit now and then)."""
    return bool(torch.ops.kvserve.set_amx_enabled(enabled))


def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table_row: Tensor,
                            seq_len: int, scale: float, window: int | None) -> Tensor:
    """One request's new tokens q [Lq, H, D] (positions seq_len - Lq ..) over its paged cache -> [Lq, H*D].

    bf16 with a kernel set loaded, head_dim a multiple of 32 (`attention_kernels_apply`)."""
    return torch.ops.kvserve.paged_prefill_attention(q, k_cache, v_cache, block_table_row, seq_len, scale,
                                                     window or 0)


def attention_kernels_apply(q: Tensor, head_dim: int) -> bool:
    """Whether the paged attention kernels take q (bf16 with a kernel set loaded, head_dim a
    multiple of 32 up to 256); elsewhere gather + SDPA."""
    return q.is_cpu and q.dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256 and has_fast_bf16()


# The fused small ops (rms_norm, rotary_, silu_and_mul) have vectorized paths for bf16 in every kernel set that
# beat PyTorch at any batch (`python -m benchmarks.bench_kernels`); their scalar fallbacks only win where
# PyTorch's per-op dispatch dominates, so elsewhere they are used up to this many rows.
FUSED_MAX_ROWS = 64


def use_fused(x: Tensor) -> bool:
    """Whether the fused CPU ops should handle x [T, ...]: CPU, fp32/bf16, kernels built, and
    either few rows or bf16 with a kernel set loaded (its vectorized paths win at any size)."""
    if not (x.is_cpu and x.dtype in _FUSED_DTYPES and load()):
        return False
    return x.shape[0] <= FUSED_MAX_ROWS or (x.dtype == torch.bfloat16 and has_fast_bf16())


_FUSED_DTYPES = (torch.bfloat16, torch.float32)


def use_fused_bf16_rows(x: Tensor) -> bool:
    """`use_fused` for a bf16 [T, N] tensor with contiguous rows (the row-wise fused ops' input)."""
    return x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and use_fused(x)


def has_fast_bf16() -> bool:
    """True when a kernel set is loaded: the bf16 linear, attention and fused ops are the set's
    (widened to fp32 in registers where the CPU has no bf16 dot products)."""
    return isa() != "none"


def packed_linear_shape(shape: torch.Size | tuple[int, int]) -> tuple[int, int, int, int]:
    """The shape `pack_linear_weight` gives an [N, K] weight."""
    n, k = shape
    return (-(-n // 64), k // 2, 64, 2)


def pack_linear_weight(weight: Tensor, out: Tensor | None = None) -> Tensor:
    """[N, K] bf16 -> [ceil(N/64), K/2, 64, 2]: 64-column blocks, input features in pairs (K even),
    the padding rows zero. Written into `out` when given (one strided copy, no temporaries)."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"pack_linear_weight needs an even number of input features, got {k}")
    if out is None:
        out = torch.empty(packed_linear_shape(weight.shape), dtype=weight.dtype, device=weight.device)
    full, rem = divmod(n, 64)
    out[:full].copy_(weight[: full * 64].view(full, 64, k // 2, 2).permute(0, 2, 1, 3))
    if rem:  # the last block: its real rows, then zeros
        out[full, :, rem:].zero_()
        out[full, :, :rem].copy_(weight[full * 64 :].view(rem, k // 2, 2).permute(1, 0, 2))
    return out


def linear_bf16(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """x [..., K] bf16 @ W.T (+ bias, float32) with W packed by `pack_linear_weight` -> [..., N]."""
    if x.dim() == 2 and x.stride(1) == 1:  # the model's case: no reshapes (they cost at batch 1)
        return torch.ops.kvserve.linear_bf16(x, packed, bias, out_features)
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    y = torch.ops.kvserve.linear_bf16(flat, packed, bias, out_features)
    return y.view(*x.shape[:-1], out_features)


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                           seq_lens: Tensor, scale: float, window: int | None, bias: Tensor | None = None) -> Tensor:
    """q [B, H, D] bf16 (one token per request) over the paged cache [blocks, block_size, KvH, D] -> [B, H*D].

    `bias`: float32 [H, L] (L >= every seq_len) added to the scaled scores by distance from the
    query: key t of a request of length s gets `bias[h, L - s + t]`, so column L - 1 is the query's
    own position (T5's relative bias, `distance_bias`). Where `attention_kernels_apply`."""
    return torch.ops.kvserve.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens,
                                                    scale, window or 0, bias)


def apply_token_bitmask_(logits: Tensor, bitmask: Tensor, rows: Tensor) -> bool:
    """-inf in place for the tokens of `rows` whose bit in `bitmask` ([B, ceil(V/32)] int32) is 0;
    False (nothing done) where the C++ kernels are unavailable."""
    if not (logits.is_cpu and logits.stride(-1) == 1 and load()):
        return False
    torch.ops.kvserve.apply_token_bitmask_(logits, bitmask, rows)
    return True


def logprobs_topk(logits: Tensor, token_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """The log-softmax of logits [B, V] (bf16 or fp32 rows, in fp32) at token_ids [B] and its top k
    (values descending, ties to the lower id): (logprobs [B], top logprobs [B, k], top ids [B, k]).
    One op reading each row twice with a kernel set loaded; None elsewhere (the caller's torch path)."""
    if (logits.is_cpu and logits.dtype in _FUSED_DTYPES and logits.dim() == 2 and logits.stride(-1) == 1
            and has_fast_bf16()):
        return torch.ops.kvserve.logprobs_topk(logits, token_ids, k)
    return None


def greedy_argmax(logits: Tensor) -> Tensor:
    """logits [B, V] -> [B] int64: the first index of each row's maximum (torch.argmax's answer)."""
    if logits.dtype == torch.bfloat16 and logits.is_cpu and logits.stride(-1) == 1 and has_fast_bf16():
        return torch.ops.kvserve.argmax_bf16(logits)
    return logits.argmax(dim=-1)
