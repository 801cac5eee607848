"""The gguf package's `GGUFReader`, with metadata arrays read in one pass.

The package's reader parses an array field one element at a time, each element a few numpy views
of its memory map (and every view of an `np.memmap` runs its Python hooks), so a 262,144-entry
vocabulary's tokens, token types and merges take tens of seconds. `GGUFReader` here overrides that
one step: numbers are one view cut into rows, strings are found with one loop over their length
prefixes. It builds the same fields (the same parts, data indices and types), so
`ReaderField.contents()` and transformers' GGUF conversion read the same values; the header, the
tensor infos, the tensors' memory maps and the format's constants stay the gguf package's.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

_LENGTH = struct.Struct("<Q")  # a string's byte count (little-endian files; others: the package's)


class GGUFReader(gguf.GGUFReader):
    """`gguf.GGUFReader` whose array fields are read in bulk (same fields, same values)."""

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        count_part = self._get(orig_offs + 4, np.uint64)
        itype, count = GGUFValueType(raw_itype[0]), int(count_part[0])
        start = orig_offs + 12
        plain = self.data.view(np.ndarray)  # [file bytes] uint8; its views skip memmap's hooks
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            size = np.dtype(nptype).itemsize * count
            # [count, 1]: one part per element, as the package makes them
            elements = list(plain[start : start + size].view(nptype).reshape(count, 1))
            data = list(range(2, 2 + count))
        elif itype == GGUFValueType.STRING:
            elements, end = _strings(plain, start, count)
            size = end - start
            data = list(range(3, 3 + 2 * count, 2))  # each string: its length, then its bytes
        else:  # arrays of arrays: the package's own parsing
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY, itype] if count else [GGUFValueType.ARRAY]
        return 12 + size, [raw_itype, count_part, *elements], data, types


def _strings(plain: np.ndarray, offset: int, count: int) -> tuple[list[np.ndarray], int]:
    """`count` length-prefixed strings from `offset`: [length, bytes] parts of each, and their end."""
    buffer = memoryview(plain)
    parts: list[np.ndarray] = []
    for _ in range(count):
        (length,) = _LENGTH.unpack_from(buffer, offset)
        start = offset + 8
        parts += (plain[offset:start].view(np.uint64), plain[start : start + length])
        offset = start + length
    if offset > len(plain):
        raise ValueError(f"string array runs past the end of the file ({offset} > {len(plain)})")
    return parts, offset


@contextlib.contextmanager
def bulk_arrays_everywhere() -> Iterator[None]:
    """While open, `gguf.GGUFReader` is this reader: transformers' GGUF config and tokenizer
    conversion builds its own reader by that name and then reads the same fields faster."""
    saved: Any = gguf.GGUFReader
    gguf.GGUFReader = GGUFReader
    try:
        yield
    finally:
        gguf.GGUFReader = saved
