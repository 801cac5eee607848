"""Triton kernels for CUDA (imported only by whoever uses them, so `models` imports without triton).

    models/kernels/triton_attention.py  paged decode (flash-decoding, split-K) and varlen prefill attention
    models/kernels/triton_ops.py        fused elementwise ops (rotary + K/V cache write, ...)

On the CPU they run only under Triton's interpreter (TRITON_INTERPRET=1, set before importing
triton), which is how the tests check them.
"""
