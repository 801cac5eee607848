"""CPU tensors backed by transparent huge pages (2 MiB), for the weights and the KV cache.

Decode reads hundreds of MB of weights and scattered KV blocks every step. With 4 KiB
pages that is a TLB miss every few KB, and in a virtual machine each miss is a two-level
page walk; huge pages speed up the paged-attention kernel most (docs/performance.md).
Linux only hands out huge pages for anonymous memory that asked
for them (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, a common
default), so big buffers are allocated 2 MiB-aligned and `madvise(MADV_HUGEPAGE)`d
before they are first written. Elsewhere this is a plain `torch.empty`.

`zeros` is for buffers that must start zeroed but are mostly never written (the KV pool):
a private anonymous mapping reads as zeros, and the OS supplies each (huge) page zeroed on
first touch, so allocating gigabytes costs nothing until they are used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import sys

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # pragma: no cover
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialized CPU tensor; huge-page backed when it is at least 2 MiB and the OS allows."""
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # room to align the start
    offset = -raw.data_ptr() % HUGE_PAGE
    madvise(
        raw.data_ptr() + offset, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE
    )  # advisory only
    return raw[offset : offset + nbytes].view(dtype).view(shape)  # the view keeps `raw` alive


def arena(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[Tensor]:
    """Uninitialized contiguous tensors back to back (64-byte aligned) in one huge-page buffer.

    One buffer rather than one per tensor: most weight matrices are smaller than a huge page.
    """
    itemsize = torch.tensor([], dtype=dtype).element_size()
    starts = [0]
    for shape in shapes:
        nbytes = itemsize * math.prod(shape)
        starts.append(starts[-1] + -(-nbytes // 64) * 64)
    buffer = empty((starts[-1],), torch.uint8)
    return [
        buffer[start : start + itemsize * math.prod(shape)].view(dtype).view(shape)
        for shape, start in zip(shapes, starts)
    ]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A zero CPU tensor that writes nothing now: a private anonymous mapping, whose pages the
    OS zeroes on first touch, 2 MiB-aligned and `MADV_HUGEPAGE`d. Off Linux, `torch.zeros`.
    The mapping is unmapped when the last view of the tensor is freed."""
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to `region`
    offset = (
        -raw.data_ptr() % HUGE_PAGE
    )  # a multiple of the 4 KiB page: the mapping is page-aligned
    if nbytes >= HUGE_PAGE:
        try:
            region.madvise(
                mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE
            )  # advisory only
        except (AttributeError, OSError):  # pragma: no cover - kernel without THP
            pass
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def populate(tensor: Tensor, chunk_bytes: int = 64 << 20) -> bool:
    """Fault in the pages under a CPU tensor now, as writable (a `zeros` tensor stays zero: the
    kernel zeroes the pages, nothing is written from here). Done in chunks, each a ctypes call
    that releases the GIL, so other threads run meanwhile. False where the kernel cannot."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr() - tensor.data_ptr() % mmap.PAGESIZE
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    for addr in range(start, end, chunk_bytes):
        if madvise(addr, min(chunk_bytes, end - addr), _MADV_POPULATE_WRITE) != 0:
            return False
    return True
