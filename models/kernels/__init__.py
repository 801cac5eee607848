"""Triton kernels for CUDA (imported only by whoever uses them, so `models` imports without triton).

    models/kernels/triton_attention.py  paged decode (flash-decoding, split-K) and varlen prefill attention
    models/kernels/triton_ops.py        fused elementwise ops (rotary + K/V cache write, ...)
    models/kernels/triton_quant.py      weight-only int8 / int4 matmul (models/quantization.py's formats)
    models/kernels/triton_moe.py        grouped GEMM of a mixture of experts' matrices (models/moe.py)

On the CPU they run only under Triton's interpreter (TRITON_INTERPRET=1, set before importing
triton), which is how the tests check them.
"""


def fix_interpreter_scalar_index() -> None:
    """Triton 3.6's CPU interpreter turns a scalar into an int with int(ndarray of shape (1,)), which
    numpy >= 2.4 refuses, so a `range()` with runtime bounds fails (triton-lang/triton#9171, fixed
    after 3.6). Only under TRITON_INTERPRET=1 (the tests); compiled kernels are unaffected."""
    import triton
    from triton.runtime import interpreter

    if not triton.knobs.runtime.interpret:
        return

    original = interpreter._patch_lang_tensor
    if getattr(original, "kvserve_fixed", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.kvserve_fixed = True
    interpreter._patch_lang_tensor = patched
