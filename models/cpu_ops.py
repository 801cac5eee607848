"""kvserve's CPU kernels (models/csrc/*.cpp), built on first use with the local compiler.

`load()` compiles the C++ sources once per source/torch version into a cache directory
(`$KVSERVE_CPU_OPS_DIR`, else `$KVSERVE_CACHE_DIR/cpu_ops`, else
`~/.cache/kvserve/cpu_ops`; a first build takes a while (docs/performance.md); a library already built there is
loaded without a compiler, which is how the CPU Docker image ships it) and registers
`torch.ops.kvserve.*`. Anything that goes wrong (no compiler, not x86-64,
`KVSERVE_CPU_KERNELS=0`) is logged once and the model keeps its portable PyTorch
path, so the kernels are an optimization, never a requirement.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "ops.cpp"  # includes the kernel headers next to it
_NAME = "kvserve_cpu_ops"


def _put_ninja_on_path() -> None:
    """torch's extension builder runs `ninja`; the pip package's binary may not be on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build_dir() -> Path:
    root = os.environ.get("KVSERVE_CPU_OPS_DIR")
    if not root:
        root = Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve") / "cpu_ops"
    sources = b"".join(path.read_bytes() for path in sorted(CSRC.glob("*.[ch]*")))
    digest = hashlib.sha256(sources + torch.__version__.encode()).hexdigest()[:16]
    return Path(root) / digest


@functools.cache
def load() -> bool:
    """Build (or reuse) and register the kernels; True when `torch.ops.kvserve` is usable.
    `KVSERVE_CPU_AMX=0` keeps the bf16 linear off AMX tiles (`set_amx`)."""
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return False
    if not _load_library():
        return False
    if os.environ.get("KVSERVE_CPU_AMX", "1") == "0":
        set_amx(False)
    return True


def set_amx(enabled: bool) -> bool:
    """Whether the bf16 linear multiplies 8 rows and more in AMX tiles on CPUs that have them (on by
    default); -> the previous setting. Off, every row's result is the same bits at any batch size
    (the tiles' fp32 sums differ from the AVX512 path's in the last bit now and then)."""
    return bool(torch.ops.kvserve.set_amx_enabled(enabled))


def _load_library() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    build_dir = _build_dir()
    library = build_dir / f"{_NAME}.so"
    try:
        if library.exists():
            torch.ops.load_library(str(library))
            return True
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=_NAME,
            sources=[str(SOURCE)],
            build_directory=str(build_dir),
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, headers or ninja: keep the PyTorch path
        errors = [line for line in str(exc).splitlines() if "error" in line.lower()]
        logger.warning("CPU kernels unavailable, using the PyTorch path: %s",
                       " | ".join(errors[:3])[:600] or str(exc)[:300])
        return False
    return True


def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table_row: Tensor,
                            seq_len: int, scale: float, window: int | None) -> Tensor:
    """One request's new tokens q [Lq, H, D] (positions seq_len - Lq ..) over its paged cache -> [Lq, H*D].

    bf16 on AVX512-BF16 CPUs, head_dim a multiple of 32 (`attention_kernels_apply`)."""
    return torch.ops.kvserve.paged_prefill_attention(q, k_cache, v_cache, block_table_row, seq_len, scale,
                                                     window or 0)


def attention_kernels_apply(q: Tensor, head_dim: int) -> bool:
    """Whether the paged attention kernels take q (bf16 on an AVX512-BF16 CPU, head_dim a
    multiple of 32 up to 256); elsewhere gather + SDPA is faster than scalar C++ (measured
    in fp32 here: 1.6-2x at batches of 4-64)."""
    return q.is_cpu and q.dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256 and has_fast_bf16()


# The fused small ops (rms_norm, rotary_, silu_and_mul) have AVX-512 paths for bf16 that
# beat PyTorch at any batch (`python -m benchmarks.bench_kernels`); their scalar fallbacks only win where
# PyTorch's per-op dispatch dominates, so elsewhere they are used up to this many rows.
FUSED_MAX_ROWS = 64


def use_fused(x: Tensor) -> bool:
    """Whether the fused CPU ops should handle x [T, ...]: CPU, fp32/bf16, kernels built, and
    either few rows or bf16 on an AVX512-BF16 CPU (their vectorized paths win at any size)."""
    if not (x.is_cpu and x.dtype in _FUSED_DTYPES and load()):
        return False
    return x.shape[0] <= FUSED_MAX_ROWS or (x.dtype == torch.bfloat16 and has_fast_bf16())


_FUSED_DTYPES = (torch.bfloat16, torch.float32)


def use_fused_bf16_rows(x: Tensor) -> bool:
    """`use_fused` for a bf16 [T, N] tensor with contiguous rows (the row-wise fused ops' input)."""
    return x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and use_fused(x)


@functools.cache
def has_fast_bf16() -> bool:
    """True when the kernels loaded and the CPU has AVX512-BF16 (the fast linear needs it)."""
    return load() and bool(torch.ops.kvserve.has_avx512_bf16())


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
    One op reading each row twice on AVX512-BF16 CPUs; None elsewhere (the caller's torch path)."""
    if (logits.is_cpu and logits.dtype in _FUSED_DTYPES and logits.dim() == 2 and logits.stride(-1) == 1
            and has_fast_bf16()):
        return torch.ops.kvserve.logprobs_topk(logits, token_ids, k)
    return None


def greedy_argmax(logits: Tensor) -> Tensor:
    """logits [B, V] -> [B] int64: the first index of each row's maximum (torch.argmax's answer)."""
    if logits.dtype == torch.bfloat16 and logits.is_cpu and logits.stride(-1) == 1 and has_fast_bf16():
        return torch.ops.kvserve.argmax_bf16(logits)
    return logits.argmax(dim=-1)
