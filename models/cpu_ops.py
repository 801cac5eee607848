"""kvserve's CPU kernels (models/csrc) for tensors, built on first use with the local compiler.

models/cpu_build.py compiles two plain C++ libraries (no torch headers) into a cache: the host
library (models/csrc/host/: each op's C API, the decoder stack, loading a set) and the kernel
set this CPU runs (models/cpu_isa.py: avx512, avx512vnni, avx2 or neon; `KVSERVE_CPU_ISA` forces one). This
module loads the host library with ctypes, hands it torch's thread count and pool (the C
functions `torch_get_num_threads` and `torch_parallel_for` of libtorch_cpu; a serial pool, with a
warning, on a torch without them; `use_own_pool` swaps torch's pool for kvserve's own) and has
it load the set. Each op here checks its tensors' shapes,
dtypes and strides, allocates the output and calls the C function on their data pointers.
Anything that goes wrong (no compiler, `KVSERVE_CPU_KERNELS=0`) is logged once and the model
keeps its portable PyTorch path, so the kernels are an optimization, never a requirement.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import struct
import weakref
from ctypes import c_char_p, c_float, c_int, c_int64, c_void_p
from pathlib import Path

import torch
from torch import Tensor

from kvserve.models import cpu_build, cpu_isa
from kvserve.models.cpu_build import build_all, build_set, host_library, set_library  # noqa: F401 (docker/)

logger = logging.getLogger(__name__)

_isa = "none"  # the loaded kernel set
_lib: ctypes.CDLL | None = None  # the host library, once loaded

_P, _I, _F = c_void_p, c_int64, c_float
_ARGS = [c_char_p]  # an op's arguments packed into one struct (`_pack`)
# The host library's functions: (argument types, result type); a c_char_p result is an error
# message, None on success (models/csrc/host/host.h).
_SIGNATURES = {
    "kv_init": ([_P, _P], c_int),
    "kv_num_threads": ([], c_int),
    "kv_load_kernel_set": ([c_char_p, c_char_p, c_char_p, _I], c_int),
    "kv_unload_kernel_set": ([], None),
    "kv_kernel_set": ([], c_char_p),
    "kv_has_amx": ([], c_int),
    "kv_set_amx": ([c_int], c_int),
    "kv_linear_bf16": (_ARGS, c_char_p),
    "kv_quant_linear": (_ARGS, c_char_p),
    "kv_paged_decode_attention": (_ARGS, c_char_p),
    "kv_paged_prefill_attention": (_ARGS, c_char_p),
    "kv_logprobs_topk": (_ARGS, c_char_p),
    "kv_argmax_bf16": (_ARGS, c_char_p),
    "kv_rms_norm": (_ARGS, c_char_p),
    "kv_add_rms_norm_": (_ARGS, c_char_p),
    "kv_rotary_": (_ARGS, c_char_p),
    "kv_silu_and_mul": (_ARGS, c_char_p),
    "kv_rms_norm_heads_": (_ARGS, c_char_p),
    "kv_write_kv_cache": (_ARGS, c_char_p),
    "kv_apply_token_bitmask_": (_ARGS, c_char_p),
    "kv_lora_apply": (_ARGS, c_char_p),
    "kv_stack_new": ([_F], _P),
    "kv_stack_free": ([_P], None),
    "kv_stack_add_linear": ([_P, _P, _P, _P, _I, _I, _I, _I, _I], c_char_p),
    "kv_stack_add_layer": (
        [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _F],
        c_char_p,
    ),
    "kv_stack_add_lora": ([_P, _P, _P, _I, _I, _P, _I], c_char_p),
    "kv_stack_forward": (
        [_P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _P, _P, _P, _P, _I, _I],
        c_char_p,
    ),
}


def _pack(fields: str):
    """A packer for one op's argument struct (models/csrc/host/ops.cpp): P a pointer (0 for null),
    q an int64_t, d a double; every field 8 bytes, so native packing adds no padding. One ctypes
    argument instead of one per field: ctypes' per-argument conversions cost more than a small op."""
    return struct.Struct(fields).pack


_LINEAR_BF16, _QUANT_LINEAR = _pack("PqqPqqPPq"), _pack("PqqqqPPqqPPqq")
_DECODE, _PREFILL = _pack("PqqqqqPPqqPqPqdPqqPd"), _pack("PqqqqqPPqqPqqdPd")
_LOGPROBS, _ARGMAX = _pack("PqqqqPqPPP"), _pack("PqqqP")
_RMS_NORM, _ADD_RMS_NORM, _RMS_NORM_HEADS = _pack("PqPPqqdq"), _pack("PPqPPqqd"), _pack("PqqqqPd")
_ROTARY, _SILU_AND_MUL = _pack("PqPqqqq"), _pack("PqPqq")
_WRITE_KV, _TOKEN_BITMASK = _pack("PqPqqqPPqP"), _pack("PqqqqPqPq")
_LORA_APPLY = _pack("PqPqqPPqqqqPqPPPPqq")
# models/csrc/host/host.h's Dtype codes
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_BF16, _F32 = torch.bfloat16, torch.float32


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def torch_thread_pool() -> tuple[int | None, int | None]:
    """The addresses of libtorch_cpu's `torch_parallel_for` and `torch_get_num_threads` (torch >= 2.10),
    (None, None) when this torch lacks them."""
    torch_lib = Path(torch.__file__).parent / "lib"
    for path in sorted(torch_lib.glob("libtorch_cpu.*")):
        try:
            libtorch = ctypes.CDLL(str(path))  # already loaded by `import torch`: the same handle
            fns = libtorch.torch_parallel_for, libtorch.torch_get_num_threads
        except (OSError, AttributeError):
            continue
        return tuple(ctypes.cast(fn, c_void_p).value for fn in fns)  # type: ignore[return-value]
    return None, None


def init_threads(parallel_for: int | None, num_threads: int | None) -> bool:
    """Run the kernels on as many threads as `num_threads` says (None: one thread), on the pool
    behind `parallel_for` (None: kvserve's own, models/csrc/host/pool.cpp) -> whether threaded."""
    return bool(_lib.kv_init(parallel_for, num_threads))


def use_own_pool(own: bool) -> None:
    """Run the kernels on kvserve's own thread pool (True) or on torch's OpenMP pool (False).

    An OpenMP region ends only once every thread of its team has run, so a thread the OS has
    taken off its vCPU (for the server process, a load generator, a neighbour) holds up every
    kernel call; kvserve's pool ends a call when its chunks are done. But its threads are not
    torch's: where torch's ops do much of a step's work (the Python forward), torch's spinning
    threads and kvserve's would take turns on the same cores. So the model runner picks the own
    pool when the C++ decoder stack runs the layers, torch's otherwise; `KVSERVE_CPU_POOL=kvserve`
    or `torch` fixes the choice. The choice never changes a result: both split work alike."""
    forced = os.environ.get("KVSERVE_CPU_POOL")
    if forced not in (None, "", "kvserve", "torch"):
        raise ValueError(f"KVSERVE_CPU_POOL must be kvserve or torch, not {forced!r}")
    if forced:
        own = forced == "kvserve"
    if load():
        parallel_for, num_threads = torch_thread_pool()
        init_threads(None if own else parallel_for, num_threads)


def _load_set(library: Path, name: str) -> str:
    error = ctypes.create_string_buffer(1024)
    if _lib.kv_load_kernel_set(str(library).encode(), name.encode(), error, len(error)):
        raise RuntimeError(error.value.decode(errors="replace"))
    return _lib.kv_kernel_set().decode()


def _warn_unavailable(what: str, exc: Exception) -> None:
    errors = [line for line in str(exc).splitlines() if "error" in line.lower()]
    logger.warning(
        "%s unavailable, using the PyTorch path: %s",
        what,
        " | ".join(errors[:3])[:600] or str(exc)[:300],
    )


@functools.cache
def load() -> bool:
    """Build (or reuse) and load the host library and the chosen kernel set; True when the ops here
    are usable (`isa()` says which set, "none" for none: the scalar fallbacks only).
    `KVSERVE_CPU_AMX=0` keeps the bf16 linear off AMX tiles (`set_amx`)."""
    global _isa, _lib
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return False
    chosen = cpu_isa.chosen()
    targets = [cpu_build.host_target()] + (
        [cpu_build.set_target(chosen)] if chosen != "none" else []
    )
    host, *library = cpu_build.build(targets)
    if isinstance(host, Exception):
        _warn_unavailable("CPU kernels", host)
        return False
    try:
        _lib = _open(host)
    except (OSError, AttributeError) as exc:  # a stale or foreign library
        _warn_unavailable("CPU kernels", exc)
        return False
    if not init_threads(*torch_thread_pool()):
        logger.warning(
            "torch %s has no torch_parallel_for: the CPU kernels run on one thread",
            torch.__version__,
        )
    if library and isinstance(library[0], Exception):
        _warn_unavailable("CPU kernel set", library[0])
    elif library:
        try:
            _isa = _load_set(library[0], chosen)
        except RuntimeError as exc:
            _warn_unavailable("CPU kernel set", exc)
    logger.info("CPU kernels: %s", _isa)
    if os.environ.get("KVSERVE_CPU_AMX", "1") == "0":
        set_amx(False)
    return True


def isa() -> str:
    """The kernel set the ops call: "avx512", "avx512vnni", "avx2", "neon", or "none" (PyTorch's ops only)."""
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
        raise ValueError(
            f"kernel set {name!r} cannot run here: this CPU lacks {', '.join(missing)}"
        )
    if name == "none":
        _lib.kv_unload_kernel_set()
    else:
        _load_set(build_set(name), name)
    _isa = name
    return previous


def set_amx(enabled: bool) -> bool:
    """Whether the bf16 linear multiplies 8 rows and more in AMX tiles on CPUs that have them (on by
    default); -> the previous setting. Off, every row's result is the same bits at any batch size
    (the tiles' fp32 sums differ from the AVX512 path's in the last bit now and then)."""
    return bool(_lib.kv_set_amx(enabled)) if load() else False


def has_amx() -> bool:
    """Whether the loaded set multiplies bf16 in AMX tiles here (the CPU and the OS allow them)."""
    return bool(_lib.kv_has_amx()) if load() else False


def attention_kernels_apply(q: Tensor, head_dim: int) -> bool:
    """Whether the paged attention kernels take q (bf16 with a kernel set loaded, head_dim a
    multiple of 32 up to 256); elsewhere gather + SDPA."""
    return (
        q.is_cpu
        and q.dtype == torch.bfloat16
        and head_dim % 32 == 0
        and head_dim <= 256
        and has_fast_bf16()
    )


# The fused small ops (rms_norm, rotary_, silu_and_mul) have vectorized paths for bf16 in every kernel set that
# beat PyTorch at any batch (docs/performance.md); their scalar fallbacks only win where
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
        out = torch.empty(
            packed_linear_shape(weight.shape), dtype=weight.dtype, device=weight.device
        )
    full, rem = divmod(n, 64)
    out[:full].copy_(weight[: full * 64].view(full, 64, k // 2, 2).permute(0, 2, 1, 3))
    if rem:  # the last block: its real rows, then zeros
        out[full, :, rem:].zero_()
        out[full, :, :rem].copy_(weight[full * 64 :].view(rem, k // 2, 2).permute(1, 0, 2))
    return out


def _check(error: bytes | None) -> None:
    if error is not None:
        raise RuntimeError(error.decode(errors="replace"))


def _bias_ptr(bias: Tensor | None, n: int) -> int:
    """A linear's optional bias: float32 [>= n]; 0 (null) for none."""
    if bias is None:
        return 0
    if bias.dtype is not _F32 or not bias.is_contiguous() or bias.numel() < n:
        raise RuntimeError("bias must be float32 [N]")
    return bias.data_ptr()


def _check_n(n: int, col_blocks: int) -> None:
    if not 64 * (col_blocks - 1) < n <= 64 * col_blocks:
        raise RuntimeError(f"n={n} does not match the packed weight")


def linear_bf16(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """x [..., K] bf16 @ W.T (+ bias, float32) with W packed by `pack_linear_weight` -> [..., N]."""
    if x.dim() == 2 and x.stride(1) == 1:  # the model's case: no reshapes (they cost at batch 1)
        return _linear_bf16(x, packed, bias, out_features)
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return _linear_bf16(flat, packed, bias, out_features).view(*x.shape[:-1], out_features)


def _linear_bf16(x: Tensor, packed: Tensor, bias: Tensor | None, n: int) -> Tensor:
    if x.dtype is not _BF16 or not x.is_cpu:
        raise RuntimeError("x must be [M, K] bf16 rows")
    w_shape = packed.shape
    if (
        len(w_shape) != 4
        or w_shape[2:] != (64, 2)
        or packed.dtype is not _BF16
        or not packed.is_contiguous()
    ):
        raise RuntimeError("packed weight must be bf16 [N/64, K/2, 64, 2]")
    m, k = x.shape
    col_blocks, half_k = w_shape[0], w_shape[1]
    if k != 2 * half_k:
        raise RuntimeError(f"x has {k} features, the weight {2 * half_k}")
    _check_n(n, col_blocks)
    y = torch.empty(m, n, dtype=_BF16)
    _check(
        _lib.kv_linear_bf16(
            _LINEAR_BF16(
                x.data_ptr(),
                x.stride(0),
                m,
                packed.data_ptr(),
                half_k,
                col_blocks,
                _bias_ptr(bias, n),
                y.data_ptr(),
                n,
            )
        )
    )
    return y


def quant_linear(
    x: Tensor, packed: Tensor, scales: Tensor, bias: Tensor | None, n: int, bits: int, group: int
) -> Tensor:
    """x [M, K] bf16 or float32 rows @ the int8/int4 weight models/quantization.py packed
    ([N/64, K/4, 256 or 128] uint8, scales [N/64, K/group, 64] float16) -> [M, N] in x's dtype."""
    if bits not in (8, 4):
        raise RuntimeError(f"bits must be 8 or 4, got {bits}")
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in _FUSED_DTYPES or not x.is_cpu:
        raise RuntimeError("x must be [M, K] bf16 or float32 rows")
    step_bytes = 256 if bits == 8 else 128
    if (
        packed.dim() != 3
        or packed.shape[2] != step_bytes
        or packed.dtype is not torch.uint8
        or not packed.is_contiguous()
    ):
        raise RuntimeError(f"packed weight must be uint8 [N/64, K/4, {step_bytes}]")
    m, k = x.shape
    col_blocks = packed.shape[0]
    if group <= 0 or group % 16 or k % group:
        raise RuntimeError(f"group {group} must be a multiple of 16 dividing K={k}")
    if packed.shape[1] * 4 != k:
        raise RuntimeError(f"x has {k} features, the weight {packed.shape[1] * 4}")
    _check_n(n, col_blocks)
    if (
        scales.dtype is not torch.float16
        or not scales.is_contiguous()
        or scales.shape != (col_blocks, k // group, 64)
    ):
        raise RuntimeError("scales must be float16 [N/64, K/G, 64]")
    y = torch.empty(m, n, dtype=x.dtype)
    _check(
        _lib.kv_quant_linear(
            _QUANT_LINEAR(
                x.data_ptr(),
                x.dtype is _BF16,
                x.stride(0),
                m,
                k,
                packed.data_ptr(),
                scales.data_ptr(),
                bits,
                group,
                _bias_ptr(bias, n),
                y.data_ptr(),
                n,
                col_blocks,
            )
        )
    )
    return y


def _check_caches(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    if (
        k_cache.dim() != 4
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
        or k_cache.shape != v_cache.shape
    ):
        raise RuntimeError("caches must be contiguous [blocks, block_size, KvH, D]")
    if (
        q.dtype is not _BF16
        or k_cache.dtype is not _BF16
        or v_cache.dtype is not _BF16
        or not q.is_cpu
    ):
        raise RuntimeError("paged attention: q and the caches must be bf16 CPU tensors")
    num_heads, head_dim = q.shape[1], q.shape[2]
    if (
        k_cache.shape[3] != head_dim
        or num_heads % k_cache.shape[2]
        or head_dim % 32
        or head_dim > 256
    ):
        raise RuntimeError(
            "head shapes do not match (or head_dim is not a multiple of 32 up to 256)"
        )


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int | None,
    bias: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """q [B, H, D] bf16 (one token per request) over the paged cache [blocks, block_size, KvH, D] -> [B, H*D].

    `bias`: float32 [H, L] (L >= every seq_len) added to the scaled scores by distance from the
    query: key t of a request of length s gets `bias[h, L - s + t]`, so column L - 1 is the query's
    own position (T5's relative bias, `distance_bias`). `softcap` c: each scaled score s becomes
    c * tanh(s / c) (Gemma 2; not with `bias`). Where `attention_kernels_apply`."""
    if q.dim() != 3 or q.stride(2) != 1:
        raise RuntimeError("q must be [B, H, D] with contiguous D")
    _check_caches(q, k_cache, v_cache)
    if (
        block_table.dtype is not torch.int64
        or block_table.stride(1) != 1
        or seq_lens.dtype is not torch.int64
        or not seq_lens.is_contiguous()
    ):
        raise RuntimeError("block_table and seq_lens must be int64")
    num_reqs, num_heads, head_dim = q.shape
    if block_table.shape[0] < num_reqs or seq_lens.numel() < num_reqs:
        raise RuntimeError("one table row per request")
    bias_ptr = bias_stride = bias_len = 0
    if bias is not None:
        if (
            bias.dtype is not _F32
            or bias.dim() != 2
            or bias.shape[0] != num_heads
            or (bias.stride(1) != 1 and bias.shape[1] != 1)
        ):
            raise RuntimeError("bias must be float32 [H, L] with contiguous rows")
        bias_ptr, bias_stride, bias_len = bias.data_ptr(), bias.stride(0), bias.shape[1]
    out = torch.empty(num_reqs, num_heads * head_dim, dtype=_BF16)
    _check(
        _lib.kv_paged_decode_attention(
            _DECODE(
                q.data_ptr(),
                q.stride(0),
                q.stride(1),
                num_reqs,
                num_heads,
                head_dim,
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                k_cache.shape[2],
                k_cache.shape[1],
                block_table.data_ptr(),
                block_table.stride(0),
                seq_lens.data_ptr(),
                window or 0,
                scale,
                bias_ptr,
                bias_stride,
                bias_len,
                out.data_ptr(),
                softcap or 0.0,
            )
        )
    )
    return out


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table_row: Tensor,
    seq_len: int,
    scale: float,
    window: int | None,
    softcap: float | None = None,
) -> Tensor:
    """One request's new tokens q [Lq, H, D] (positions seq_len - Lq ..) over its paged cache -> [Lq, H*D].

    bf16 with a kernel set loaded, head_dim a multiple of 32 (`attention_kernels_apply`); `softcap` as
    in `paged_decode_attention`."""
    if q.dim() != 3 or q.stride(2) != 1:
        raise RuntimeError("q must be [Lq, H, D] bf16")
    _check_caches(q, k_cache, v_cache)
    if (
        block_table_row.dim() != 1
        or block_table_row.dtype is not torch.int64
        or not block_table_row.is_contiguous()
    ):
        raise RuntimeError("block_table must be one int64 row")
    lq, num_heads, head_dim = q.shape
    if not 0 < lq <= seq_len or block_table_row.numel() * k_cache.shape[1] < seq_len:
        raise RuntimeError("seq_len must cover the queries and fit the block table")
    out = torch.empty(lq, num_heads * head_dim, dtype=_BF16)
    _check(
        _lib.kv_paged_prefill_attention(
            _PREFILL(
                q.data_ptr(),
                q.stride(0),
                q.stride(1),
                lq,
                num_heads,
                head_dim,
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                k_cache.shape[2],
                k_cache.shape[1],
                block_table_row.data_ptr(),
                seq_len,
                window or 0,
                scale,
                out.data_ptr(),
                softcap or 0.0,
            )
        )
    )
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [T, N] rows (float32 or bf16) with Hugging Face's roundings -> [T, N]: the set's
    kernel for bf16 with one loaded, else a plain loop."""
    dtype, stride = x.dtype, x.stride()
    if (
        len(stride) != 2
        or stride[1] != 1
        or weight.shape != x.shape[1:]
        or not weight.is_contiguous()
        or weight.dtype is not dtype
        or not x.is_cpu
    ):
        raise RuntimeError("rms_norm: x [T, N] rows and weight [N] of one dtype")
    if dtype is not _BF16 and dtype is not _F32:
        raise RuntimeError("rms_norm supports float32 and bfloat16")
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=dtype)
    _check(
        _lib.kv_rms_norm(
            _RMS_NORM(
                x.data_ptr(),
                stride[0],
                weight.data_ptr(),
                out.data_ptr(),
                rows,
                n,
                eps,
                dtype is _BF16,
            )
        )
    )  # host.h's Dtype: 1 bf16, 0 float32
    return out


def add_rms_norm_(residual: Tensor, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The pre-norm residual step, bf16: residual [T, N] (contiguous) += x [T, N] rows, rounded as
    `residual + x` is, then -> `rms_norm` of the new residual."""
    shape, stride, dtype = x.shape, x.stride(), x.dtype
    if (
        len(shape) != 2
        or stride[1] != 1
        or residual.shape != shape
        or not residual.is_contiguous()
        or weight.shape != shape[1:]
        or not weight.is_contiguous()
        or residual.dtype is not dtype
        or weight.dtype is not dtype
        or not x.is_cpu
    ):
        raise RuntimeError(
            "add_rms_norm_: residual [T, N] contiguous, x [T, N] rows and weight [N] of one dtype"
        )
    if dtype is not _BF16:
        raise RuntimeError("add_rms_norm_ supports bfloat16")
    rows, n = shape
    out = torch.empty(rows, n, dtype=_BF16)
    _check(
        _lib.kv_add_rms_norm_(
            _ADD_RMS_NORM(
                residual.data_ptr(),
                x.data_ptr(),
                stride[0],
                weight.data_ptr(),
                out.data_ptr(),
                rows,
                n,
                eps,
            )
        )
    )
    return out


def rotary_(x: Tensor, cos_sin: Tensor, num_heads: int, head_dim: int) -> None:
    """Neox rotary in place on the first `num_heads` heads of each row of x [T, >= heads * D]
    (float32 or bf16), cos_sin [T, 2, D] as models/layers.py caches it; PyTorch's roundings."""
    shape, stride, dtype = x.shape, x.stride(), x.dtype
    if (
        len(shape) != 2
        or stride[1] != 1
        or shape[1] < num_heads * head_dim
        or head_dim % 2
        or not x.is_cpu
    ):
        raise RuntimeError("rotary_: x must be [T, >= heads * D] rows")
    if (
        cos_sin.shape != (shape[0], 2, head_dim)
        or cos_sin.dtype is not dtype
        or not cos_sin.is_contiguous()
    ):
        raise RuntimeError("rotary_: cos_sin must be [T, 2, D] in x's dtype")
    if dtype is not _BF16 and dtype is not _F32:
        raise RuntimeError("rotary_ supports float32 and bfloat16")
    _check(
        _lib.kv_rotary_(
            _ROTARY(
                x.data_ptr(),
                stride[0],
                cos_sin.data_ptr(),
                shape[0],
                num_heads,
                head_dim,
                dtype is _BF16,
            )
        )
    )


def silu_and_mul(x: Tensor) -> Tensor:
    """silu(gate) * up for x = [gate | up] bf16 rows [T, 2 * I] -> [T, I], with the two roundings of
    `F.silu(gate) * up` (a kernel set's)."""
    shape, stride = x.shape, x.stride()
    if len(shape) != 2 or stride[1] != 1 or shape[1] % 2 or x.dtype is not _BF16 or not x.is_cpu:
        raise RuntimeError("silu_and_mul: x must be [T, 2 * I] bf16 rows")
    rows, n = shape[0], shape[1] // 2
    out = torch.empty(rows, n, dtype=_BF16)
    _check(_lib.kv_silu_and_mul(_SILU_AND_MUL(x.data_ptr(), stride[0], out.data_ptr(), rows, n)))
    return out


def rms_norm_heads_(heads: Tensor, weight: Tensor, eps: float) -> None:
    """`rms_norm` of every head of heads [T, H, D] bf16 (heads side by side, rows of a wider tensor
    such as Qwen3's q or k within qkv), in place, with the set's kernel."""
    if (
        heads.dim() != 3
        or heads.stride(2) != 1
        or heads.stride(1) != heads.shape[2]
        or heads.dtype is not _BF16
    ):
        raise RuntimeError("rms_norm_heads_: heads must be bf16 [T, H, D] with contiguous heads")
    if (
        weight.dtype is not _BF16
        or not weight.is_contiguous()
        or weight.numel() != heads.shape[2]
        or not heads.is_cpu
    ):
        raise RuntimeError("rms_norm_heads_: weight must be bf16 [D]")
    _check(
        _lib.kv_rms_norm_heads_(
            _RMS_NORM_HEADS(heads.data_ptr(), heads.stride(0), *heads.shape, weight.data_ptr(), eps)
        )
    )


def write_kv_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """The new tokens' keys and values k, v [T, KvH, D] (contiguous heads, any row stride) into their
    cache slots (caches [blocks, block_size, KvH, D]): one op for both caches."""
    shape, k_stride, v_stride, cache_shape = k.shape, k.stride(), v.stride(), k_cache.shape
    if (
        len(shape) != 3
        or v.shape != shape
        or k_stride[1:] != (shape[2], 1)
        or v_stride[1:] != (shape[2], 1)
        or not k.is_cpu
    ):
        raise RuntimeError("write_kv_cache: k and v must be [T, KvH, D] with contiguous heads")
    if (
        len(cache_shape) != 4
        or v_cache.shape != cache_shape
        or cache_shape[2:] != shape[1:]
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
    ):
        raise RuntimeError(
            "write_kv_cache: caches must be contiguous [blocks, block_size, KvH, D] matching k"
        )
    dtype = k.dtype
    if v.dtype is not dtype or k_cache.dtype is not dtype or v_cache.dtype is not dtype:
        raise RuntimeError("write_kv_cache: one dtype for k, v and the caches")
    rows = shape[0]
    if slots.shape != (rows,) or slots.dtype is not torch.int64 or not slots.is_contiguous():
        raise RuntimeError("write_kv_cache: slots must be int64 [T]")
    size = k.element_size()
    _check(
        _lib.kv_write_kv_cache(
            _WRITE_KV(
                k.data_ptr(),
                k_stride[0] * size,
                v.data_ptr(),
                v_stride[0] * size,
                rows,
                shape[1] * shape[2] * size,
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                cache_shape[0] * cache_shape[1],
                slots.data_ptr(),
            )
        )
    )


def apply_token_bitmask_(logits: Tensor, bitmask: Tensor, rows: Tensor) -> bool:
    """-inf in place for the tokens of `rows` whose bit in `bitmask` ([B, ceil(V/32)] int32) is 0;
    False (nothing done) where the C++ kernels are unavailable."""
    if not (logits.is_cpu and logits.stride(-1) == 1 and load()):
        return False
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise RuntimeError(
            "apply_token_bitmask_: logits must be [B, V] rows of float32, float64, bf16 or float16"
        )
    if (
        bitmask.dim() != 2
        or not bitmask.is_contiguous()
        or bitmask.dtype is not torch.int32
        or bitmask.shape[0] != logits.shape[0]
    ):
        raise RuntimeError("apply_token_bitmask_: bitmask must be a contiguous [B, W] int32 tensor")
    if rows.dim() != 1 or not rows.is_contiguous() or rows.dtype is not torch.int64:
        raise RuntimeError("apply_token_bitmask_: rows must be a 1-D int64 tensor")
    _check(
        _lib.kv_apply_token_bitmask_(
            _TOKEN_BITMASK(
                logits.data_ptr(),
                logits.stride(0),
                logits.shape[1],
                logits.shape[0],
                _DTYPES[logits.dtype],
                bitmask.data_ptr(),
                bitmask.shape[1],
                rows.data_ptr(),
                rows.numel(),
            )
        )
    )
    return True


def logprobs_topk(
    logits: Tensor, token_ids: Tensor, k: int
) -> tuple[Tensor, Tensor, Tensor] | None:
    """The log-softmax of logits [B, V] (bf16 or fp32 rows, in fp32) at token_ids [B] and its top k
    (values descending, ties to the lower id): (logprobs [B], top logprobs [B, k], top ids [B, k]).
    One op reading each row twice with a kernel set loaded; None elsewhere (the caller's torch path)."""
    if not (
        logits.is_cpu
        and logits.dtype in _FUSED_DTYPES
        and logits.dim() == 2
        and logits.stride(-1) == 1
        and has_fast_bf16()
    ):
        return None
    b, v = logits.shape
    if (
        token_ids.shape != (b,)
        or token_ids.dtype is not torch.int64
        or not token_ids.is_contiguous()
    ):
        raise RuntimeError("token_ids must be int64 [B]")
    if not 0 <= k <= v:
        raise RuntimeError("k must be in [0, V]")
    sampled, top_vals = torch.empty(b, dtype=_F32), torch.empty(b, k, dtype=_F32)
    top_ids = torch.empty(b, k, dtype=torch.int64)
    _check(
        _lib.kv_logprobs_topk(
            _LOGPROBS(
                logits.data_ptr(),
                logits.dtype is _BF16,
                logits.stride(0),
                b,
                v,
                token_ids.data_ptr(),
                k,
                sampled.data_ptr(),
                top_vals.data_ptr(),
                top_ids.data_ptr(),
            )
        )
    )
    return sampled, top_vals, top_ids


def argmax_bf16(logits: Tensor) -> Tensor:
    """logits [B, V] bf16 rows -> [B] int64, the first index of each row's maximum (a kernel set's)."""
    if (
        logits.dim() != 2
        or logits.dtype is not _BF16
        or logits.stride(1) != 1
        or not 0 < logits.shape[1] < 2**31
        or not logits.is_cpu
    ):
        raise RuntimeError("argmax_bf16: logits must be [B, V] bf16 rows")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _check(
        _lib.kv_argmax_bf16(
            _ARGMAX(
                logits.data_ptr(),
                logits.stride(0),
                logits.shape[0],
                logits.shape[1],
                out.data_ptr(),
            )
        )
    )
    return out


def greedy_argmax(logits: Tensor) -> Tensor:
    """logits [B, V] -> [B] int64: the first index of each row's maximum (torch.argmax's answer)."""
    if (
        logits.dtype == torch.bfloat16
        and logits.is_cpu
        and logits.stride(-1) == 1
        and has_fast_bf16()
    ):
        return argmax_bf16(logits)
    return logits.argmax(dim=-1)


def _check_lora(a: Tensor, b: Tensor, shard_n: Tensor, rank_pad: int, k: int, n: int) -> None:
    """A LoRA'd linear's packed slots (models/lora_cpu.py): a [S, ceil(shards * rank_pad / 16), k, 16],
    b [S, rank_pad, sum of shard_n rounded up to 16], both contiguous bf16; shard_n int64 [shards]."""
    shards = shard_n.tolist() if shard_n.dtype is torch.int64 and shard_n.is_contiguous() else None
    if (
        shards is None
        or sum(shards) != n
        or a.dim() != 4
        or b.dim() != 3
        or a.shape[0] != b.shape[0]
        or a.shape[1:] != (-(-len(shards) * rank_pad // 16), k, 16)
        or b.shape[1:] != (rank_pad, sum(-(-m // 16) * 16 for m in shards))
        or a.dtype is not _BF16
        or b.dtype is not _BF16
        or not a.is_contiguous()
        or not b.is_contiguous()
    ):
        raise RuntimeError(
            "LoRA: packed slots must be contiguous bf16 shaped by models/lora_cpu.py"
        )


def _lora_rows(rows: tuple[Tensor, Tensor, Tensor, Tensor]) -> tuple[int, int, int, int, int, int]:
    """(token_order int64 [R], seg_starts, seg_lens, seg_slots int32 [L]) -> their pointers and L, R."""
    order, starts, lens, slots = rows
    if (
        order.dtype is not torch.int64
        or any(
            t.dtype is not torch.int32 or t.numel() != starts.numel() for t in (starts, lens, slots)
        )
        or not all(t.is_contiguous() and t.is_cpu for t in rows)
    ):
        raise RuntimeError(
            "LoRA: token_order must be int64, the segments' starts, lengths and slots int32 [L]"
        )
    return (
        order.data_ptr(),
        starts.data_ptr(),
        lens.data_ptr(),
        slots.data_ptr(),
        starts.numel(),
        order.numel(),
    )


def lora_apply_(
    y: Tensor,
    x: Tensor,
    a: Tensor,
    b: Tensor,
    shard_n: Tensor,
    rank_pad: int,
    rows: tuple[Tensor, Tensor, Tensor, Tensor],
) -> None:
    """y [T, n] += each adapted row's (x [T, k] @ A[slot].T) @ B[slot].T, bf16 rows, with the slots
    packed by models/lora_cpu.py and `rows` models/lora.py's grouping (token_order, seg_starts,
    seg_lens, seg_slots); lora.cpp's narrow shrink and expand (models/csrc/host/lora.cpp)."""
    if (
        x.dim() != 2
        or y.dim() != 2
        or x.shape[0] != y.shape[0]
        or x.stride(1) != 1
        or y.stride(1) != 1
        or x.dtype is not _BF16
        or y.dtype is not _BF16
        or not x.is_cpu
        or not y.is_cpu
    ):
        raise RuntimeError("LoRA: x [T, in] and y [T, out] must be bf16 rows")
    _check_lora(a, b, shard_n, rank_pad, x.shape[1], y.shape[1])
    _check(
        _lib.kv_lora_apply(
            _LORA_APPLY(
                x.data_ptr(),
                x.stride(0),
                y.data_ptr(),
                y.stride(0),
                x.shape[0],
                a.data_ptr(),
                b.data_ptr(),
                x.shape[1],
                y.shape[1],
                shard_n.numel(),
                rank_pad,
                shard_n.data_ptr(),
                a.shape[0],
                *_lora_rows(rows),
            )
        )
    )


class DecoderStack:
    """A Llama-family model's decoder layers as one C++ call per step (the host library's
    models/csrc/host/decoder_stack.cpp; models/cpu_stack.py builds one). The C++ side points into
    the weights and caches given to it: this object keeps those tensors alive, and frees the C++
    stack with itself."""

    def __init__(self, final_eps: float) -> None:
        if not has_fast_bf16():
            raise RuntimeError("the decoder stack needs a CPU kernel set (models/cpu_ops.load)")
        self._handle = _lib.kv_stack_new(final_eps)
        weakref.finalize(self, _lib.kv_stack_free, self._handle)
        self._tensors: list[Tensor] = []
        self.hidden_size = self.head_dim = 0
        self._last_linear = (0, 0)  # (k, n) of the last add_linear

    def add_linear(
        self,
        packed: Tensor,
        scales: Tensor | None,
        bias: Tensor | None,
        n: int,
        bits: int,
        group: int,
    ) -> None:
        """One matmul's weight: bf16 packed by `pack_linear_weight` (bits 16) or int8/int4 packed by
        models/quantization.py (bits 8 or 4, with its scales). Each layer's four, in order, before it."""
        if bits == 16 and (
            packed.dim() != 4 or packed.shape[2:] != (64, 2) or packed.dtype is not _BF16
        ):
            raise RuntimeError("DecoderStack: a bf16 weight must be packed [N/64, K/2, 64, 2]")
        if bits != 16 and (
            packed.dim() != 3
            or packed.dtype is not torch.uint8
            or scales is None
            or scales.dtype is not torch.float16
            or not scales.is_contiguous()
        ):
            raise RuntimeError(
                "DecoderStack: a quantized weight must be uint8 [N/64, K/4, S] with float16 scales"
            )
        if not packed.is_contiguous():
            raise RuntimeError("DecoderStack: packed weights must be contiguous")
        _check_n(n, packed.shape[0])
        k = packed.shape[1] * (2 if bits == 16 else 4)
        _check(
            _lib.kv_stack_add_linear(
                self._handle,
                packed.data_ptr(),
                None if scales is None else scales.data_ptr(),
                _bias_ptr(bias, n),
                n,
                k,
                packed.shape[0],
                bits,
                group,
            )
        )
        self._tensors += [t for t in (packed, scales, bias) if t is not None]
        self._last_linear = (k, n)

    def add_lora(self, a: Tensor, b: Tensor, shard_n: Tensor, rank_pad: int) -> None:
        """Adapter slots (packed by models/lora_cpu.py) on the last `add_linear`'s matmul."""
        _check_lora(a, b, shard_n, rank_pad, *self._last_linear)
        _check(
            _lib.kv_stack_add_lora(
                self._handle,
                a.data_ptr(),
                b.data_ptr(),
                shard_n.numel(),
                rank_pad,
                shard_n.data_ptr(),
                a.shape[0],
            )
        )
        self._tensors += [a, b, shard_n]

    def add_layer(
        self,
        input_norm: Tensor,
        post_norm: Tensor,
        q_norm: Tensor | None,
        k_norm: Tensor | None,
        k_cache: Tensor,
        v_cache: Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        window: int,
        scale: float,
        eps: float,
    ) -> None:
        """A layer over the last four `add_linear`s (qkv, o, gate_up, down): its norms' weights (bf16;
        q_norm and k_norm [D] for Qwen3, else None) and its caches [blocks, block_size, KvH, D]."""
        norms = [t for t in (input_norm, post_norm, q_norm, k_norm) if t is not None]
        if (
            any(t.dtype is not _BF16 or not t.is_contiguous() for t in norms)
            or post_norm.numel() != input_norm.numel()
        ):
            raise RuntimeError("DecoderStack: norm weights must be contiguous bf16 [hidden]")
        if (q_norm is None) != (k_norm is None) or any(t.numel() != head_dim for t in norms[2:]):
            raise RuntimeError(
                "DecoderStack: q_norm and k_norm must both be bf16 [head_dim], or both None"
            )
        if (
            k_cache.dim() != 4
            or k_cache.shape != v_cache.shape
            or k_cache.shape[2:] != (num_kv_heads, head_dim)
            or k_cache.dtype is not _BF16
            or v_cache.dtype is not _BF16
            or not k_cache.is_contiguous()
            or not v_cache.is_contiguous()
        ):
            raise RuntimeError(
                "DecoderStack: caches must be contiguous bf16 [blocks, block_size, KvH, D]"
            )
        if head_dim % 32 or head_dim > 256 or num_heads % num_kv_heads:
            raise RuntimeError(
                "DecoderStack: head shapes do not match (or head_dim is not a multiple of 32 up to 256)"
            )
        _check(
            _lib.kv_stack_add_layer(
                self._handle,
                input_norm.data_ptr(),
                post_norm.data_ptr(),
                None if q_norm is None else q_norm.data_ptr(),
                None if k_norm is None else k_norm.data_ptr(),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                k_cache.shape[0],
                k_cache.shape[1],
                input_norm.numel(),
                num_heads,
                num_kv_heads,
                head_dim,
                window,
                scale,
                eps,
            )
        )
        self._tensors += [*norms, k_cache, v_cache]
        self.hidden_size, self.head_dim = input_norm.numel(), head_dim

    def forward(
        self,
        x: Tensor,
        final_norm: Tensor,
        cos_sin: Tensor,
        slots: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
        query_lens: list[int],
        seq_lens_cpu: list[int],
        lora_rows: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    ) -> Tensor:
        """x [T, hidden] bf16 (the embeddings; overwritten as the residual stream) -> the final
        norm's output [T, hidden]. cos_sin [T, 2, D]; slots [T]; block_table [B, max_blocks] and
        seq_lens [B] int64; query_lens / seq_lens_cpu: each request's new and total token counts;
        lora_rows: the rows that use an adapter, grouped by slot (as `lora_apply_`), or None."""
        num_tokens, num_reqs = x.shape[0], len(query_lens)
        if (
            x.dim() != 2
            or x.shape[1] != self.hidden_size
            or x.dtype is not _BF16
            or not x.is_contiguous()
        ):
            raise RuntimeError(f"DecoderStack: x must be contiguous bf16 [T, {self.hidden_size}]")
        if (
            final_norm.dtype is not _BF16
            or not final_norm.is_contiguous()
            or final_norm.numel() != self.hidden_size
            or cos_sin.dtype is not _BF16
            or not cos_sin.is_contiguous()
            or cos_sin.shape != (num_tokens, 2, self.head_dim)
        ):
            raise RuntimeError(
                "DecoderStack: final_norm must be bf16 [hidden] and cos_sin bf16 [T, 2, D]"
            )
        if any(
            t.dtype is not torch.int64 or not t.is_contiguous()
            for t in (slots, block_table, seq_lens)
        ) or (
            slots.numel() != num_tokens
            or block_table.dim() != 2
            or block_table.shape[0] < num_reqs
            or seq_lens.numel() < num_reqs
            or len(seq_lens_cpu) != num_reqs
        ):
            raise RuntimeError(
                "DecoderStack: slots [T], block_table [B, max_blocks] and seq_lens [B] must be "
                "contiguous int64, with one query and one sequence length per request"
            )
        out = torch.empty_like(x)
        _check(
            _lib.kv_stack_forward(
                self._handle,
                x.data_ptr(),
                out.data_ptr(),
                final_norm.data_ptr(),
                cos_sin.data_ptr(),
                slots.data_ptr(),
                block_table.data_ptr(),
                block_table.shape[1],
                seq_lens.data_ptr(),
                (c_int64 * num_reqs)(*query_lens),
                (c_int64 * num_reqs)(*seq_lens_cpu),
                num_reqs,
                num_tokens,
                *((None, None, None, None, 0, 0) if lora_rows is None else _lora_rows(lora_rows)),
            )
        )
        return out
