"""llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K) written from float weights, for test files.

The gguf package dequantizes these types but cannot quantize to them, so the tests build the
blocks here: a plain min/max quantizer (not llama.cpp's search for the best scales, which only
changes which block a weight gets) packed in exactly the byte layout `gguf.quants` reads. What
the tests check is that kvserve reads a file's blocks as the gguf package's reference does, so
the blocks need only be valid and close to the weights (for logits worth comparing).

A super-block is 256 weights of a row; `quantize_k(w [rows, cols], name)` needs cols % 256 == 0.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _affine_blocks(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's `w = d * sc * q - dmin * m` on x [n, 8, 32]: (d, dmin fp16 [n], sc, m 6-bit
    [n, 8], q [n, 8, 32] in [0, levels))."""
    low = np.minimum(x.min(-1), 0)  # [n, 8]: -dmin * m
    scale = (x.max(-1) - low) / (levels - 1)  # [n, 8]
    d = _f16(scale.max(-1) / 63)
    dmin = _f16(-low.min(-1) / 63)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(
        np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63
    ).astype(np.uint8)
    m = np.clip(
        np.round(np.divide(-low, dmin32, out=np.zeros_like(low), where=dmin32 > 0)), 0, 63
    ).astype(np.uint8)
    step = (d32 * sc)[..., None]  # [n, 8, 1]
    shifted = x + (dmin32 * m)[..., None]
    q = np.round(np.divide(shifted, step, out=np.zeros_like(x), where=step > 0))
    return d, dmin, sc, m, np.clip(q, 0, levels - 1).astype(np.uint8)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> the 12 bytes `gguf.quants.Q4_K.get_scale_min` unpacks."""
    d_bytes = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m_bytes = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([d_bytes, m_bytes, md], axis=-1).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [n, 256] (4 low bits used) -> [n, 128]: byte r*32+l holds q[r*64+l] low, q[r*64+32+l] high."""
    q = q.reshape(len(q), 4, 2, 32) & 0x0F
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(q), 128).astype(np.uint8)


def q4_k(x: np.ndarray) -> np.ndarray:  # x [n, 256] -> [n, 144]
    d, dmin, sc, m, q = _affine_blocks(x.reshape(-1, 8, 32), 16)
    return np.concatenate(
        [
            d.view(np.uint8).reshape(-1, 2),
            dmin.view(np.uint8).reshape(-1, 2),
            _pack_scales(sc, m),
            _nibbles(q.reshape(-1, QK_K)),
        ],
        axis=-1,
    )


def q5_k(x: np.ndarray) -> np.ndarray:  # x [n, 256] -> [n, 176]
    d, dmin, sc, m, q = _affine_blocks(x.reshape(-1, 8, 32), 32)
    q = q.reshape(-1, QK_K)
    high = (q >> 4).reshape(-1, 8, 32) & 1  # bit k of byte l: the fifth bit of q[k*32+l]
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
    return np.concatenate(
        [
            d.view(np.uint8).reshape(-1, 2),
            dmin.view(np.uint8).reshape(-1, 2),
            _pack_scales(sc, m),
            qh,
            _nibbles(q),
        ],
        axis=-1,
    )


def q6_k(x: np.ndarray) -> np.ndarray:  # x [n, 256] -> [n, 210]
    x = x.reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 32  # [n, 16] per sub-block, q - 32 in [-32, 31]
    d = _f16(scale.max(-1) / 127)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(
        np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), -128, 127
    ).astype(np.int8)
    step = (d32 * sc)[..., None]
    q = np.round(np.divide(x, step, out=np.zeros_like(x), where=step != 0))
    u = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128
    low, high = u & 0x0F, u >> 4
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(-1, 128)
    qh = (
        high[..., :32] | (high[..., 32:64] << 2) | (high[..., 64:96] << 4) | (high[..., 96:] << 6)
    ).reshape(-1, 64)
    return np.concatenate(
        [ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=-1
    ).astype(np.uint8)


def quantize_k(w: np.ndarray, name: str) -> np.ndarray:
    """w [rows, cols] (cols % 256 == 0) -> the `name` tensor's bytes [rows, cols / 256 * block bytes]."""
    encode = {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}[name]
    if w.shape[-1] % QK_K:
        raise ValueError(f"{name} needs rows of a multiple of {QK_K} weights, got {w.shape[-1]}")
    blocks = encode(w.astype(np.float32).reshape(-1, QK_K))
    return blocks.reshape(*w.shape[:-1], -1)
