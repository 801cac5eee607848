"""The attention backends' names and the quantization methods, in a module without torch so that
configuration (EngineArgs, the CLI) can offer and check them before anything loads.
`models/attention/backend.py` picks the backend; models/quantization.py quantizes."""

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")  # auto: cpu on CPU, triton on CUDA

# Weight quantization (models/quantization.py): what `--quantization` accepts, and its default group.
QUANTIZATION_METHODS = ("none", "int8", "int4", "fp8")  # fp8: for GPUs (no CPU kernel)
DEFAULT_GROUP_SIZE = 32


def check_quantization(method: str | None, group_size: int) -> None:
    """ValueError naming a quantization method or group size kvserve does not support."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization {method!r} is not supported (supported: {', '.join(QUANTIZATION_METHODS)})"
        )
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size <= 0
        or group_size % 16
    ):
        raise ValueError(
            f"quantization_group_size must be a positive multiple of 16, got {group_size!r}"
        )
