"""models/kernels/triton_ops.py on the CPU under Triton's interpreter, against the torch references.

The interpreter converts fp32 -> bf16 by truncation (a GPU rounds to nearest even); the
`nearest_even_bf16` fixture makes it round like the GPU, so bf16 results can be compared
at 1 ulp (the remaining difference is fp32 rounding noise: sum order, rsqrt, exp).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest
import torch

pytest.importorskip("numpy")
pytest.importorskip("triton")

import numpy as np  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from kvserve.models.fused_ops import TORCH_OPS  # noqa: E402
from kvserve.models.kernels import triton_ops  # noqa: E402
from kvserve.models.layers import RMSNorm, RotaryEmbedding, apply_rotary  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def nearest_even_bf16(monkeypatch):
    original = interpreter._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype.primitive_bitwidth == 32 and output_dtype.name == "bf16":
            as_bf16 = torch.from_numpy(np.ascontiguousarray(data).view(np.float32)).to(
                torch.bfloat16
            )
            return as_bf16.view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        return original(data, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """Float bits as integers ordered like the values (so adjacent floats differ by 1)."""
    int_dtype = {2: torch.int16, 4: torch.int32}[x.element_size()]
    bits = x.contiguous().view(int_dtype).long()
    magnitude = bits & (2 ** (8 * x.element_size() - 1) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 1) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
        return
    diff = (ordered_bits(actual) - ordered_bits(expected)).abs().max().item()
    assert diff <= ulps, f"{diff} ulps apart"


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # inputs independent of the tests that ran before


def rows_view(num_rows: int, num_cols: int, dtype: torch.dtype, pad: int = 7) -> torch.Tensor:
    """[num_rows, num_cols] with a row stride of num_cols + pad (a slice of a wider buffer)."""
    return torch.randn(num_rows, num_cols + pad).to(dtype)[:, :num_cols]


def norm_module(hidden: int, dtype: torch.dtype, eps: float = 1e-5) -> RMSNorm:
    norm = RMSNorm(hidden, eps)
    norm.weight.data = (1 + 0.3 * torch.randn(hidden)).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 576, 1000])
def test_rms_norm_matches_hf_numerics(dtype, hidden):
    norm = norm_module(hidden, dtype)
    x = rows_view(3, hidden, dtype)
    # 2 ulps: the normalized value is rounded, then scaled and rounded again, and torch's
    # fp32 sum of squares is ordered differently from the kernel's
    assert_close(triton_ops.rms_norm(x, norm.weight, norm.eps), norm(x), ulps=2)
    x3 = torch.randn(2, 2, hidden).to(dtype)  # leading dims are flattened
    assert_close(triton_ops.rms_norm(x3, norm.weight, norm.eps), norm(x3), ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 1000])
def test_fused_add_rms_norm_updates_residual_in_place(dtype, hidden):
    norm = norm_module(hidden, dtype)
    x = rows_view(4, hidden, dtype)
    residual = torch.randn(4, hidden).to(dtype)
    expected_out, expected_residual = norm.add_and_norm(x, residual.clone())
    out, new_residual = triton_ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert new_residual is residual
    assert torch.equal(residual, expected_residual)  # one rounding of the exact sum, like torch
    assert_close(out, expected_out, ulps=2)  # (as in test_rms_norm_matches_hf_numerics)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [72, 1100])  # 1100: two column blocks, the last one masked
def test_silu_and_mul_matches_torch(dtype, intermediate):
    x = rows_view(3, 2 * intermediate, dtype)
    assert_close(triton_ops.silu_and_mul(x), TORCH_OPS.silu_and_mul(x))


def rope(head_dim: int, dtype: torch.dtype, max_position: int = 64) -> torch.Tensor:
    rotary = RotaryEmbedding(
        head_dim, max_position, {"rope_type": "default", "rope_theta": 10000.0}
    )
    return rotary.cos_sin_cache.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(4, 2, 64), (6, 2, 80), (3, 3, 96), (4, 1, 128), (2, 1, 256)],
)
def test_rotary_and_cache_write_on_packed_qkv(dtype, num_heads, num_kv_heads, head_dim):
    num_tokens, num_blocks, block_size, pad = 5, 4, 4, 8
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size + pad).to(
        dtype
    )  # rows padded: strided views
    original = qkv.clone()
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(num_tokens, num_kv_heads, head_dim)
    cos_sin_cache = rope(head_dim, dtype)
    positions = torch.tensor([0, 7, 3, 63, 20], dtype=torch.int64)
    slot_mapping = torch.tensor([5, 0, -1, 15, 9], dtype=torch.int32)  # row 2 is padding
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    k_cache_before, v_cache_before = k_cache.clone(), v_cache.clone()

    # reference: fp32 arithmetic on the same inputs, rounded once (HF's bf16 rounds each op)
    cos_sin = cos_sin_cache[positions].float()
    q_ref = apply_rotary(q.float(), cos_sin).to(dtype)
    k_ref = apply_rotary(k.float(), cos_sin).to(dtype)
    v_ref = v.clone()

    triton_ops.rotary_and_cache_write(
        q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping
    )

    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(v, v_ref)
    assert torch.equal(qkv[:, -pad:], original[:, -pad:])
    written = slot_mapping >= 0
    slots = slot_mapping[written].long()
    flat_k, flat_v = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )
    assert torch.equal(flat_k[slots], k[written])
    assert torch.equal(flat_v[slots], v[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], k_cache_before.view_as(flat_k)[untouched])
    assert torch.equal(flat_v[untouched], v_cache_before.view_as(flat_v)[untouched])


def test_rotary_bf16_is_within_an_ulp_or_two_of_hf_arithmetic():
    """The documented difference: HF rounds x*cos, rotated*sin and their sum to bf16; the kernel once."""
    num_heads, head_dim = 4, 64
    q = torch.randn(6, num_heads, head_dim).bfloat16()
    k = torch.randn(6, 1, head_dim).bfloat16()
    cos_sin_cache = rope(head_dim, torch.bfloat16)
    positions = torch.arange(6, dtype=torch.int32) * 9
    hf = apply_rotary(q, cos_sin_cache[positions.long()])
    k_cache = torch.zeros(2, 4, 1, head_dim, dtype=torch.bfloat16)
    triton_ops.rotary_and_cache_write(
        q,
        k,
        k.clone(),
        cos_sin_cache,
        positions,
        k_cache,
        k_cache.clone(),
        torch.full((6,), -1, dtype=torch.int32),
    )
    assert (q.float() - hf.float()).abs().max().item() <= 2 * 2**-8 * q.float().abs().max().item()
    assert not k_cache.any()  # every row was padding


def test_bad_arguments_raise_value_errors_naming_them():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"\(2, 8\) does not match weight \(6,\)"):
        triton_ops.rms_norm(x, torch.ones(6), 1e-6)
    with pytest.raises(ValueError, match="torch.float64"):
        triton_ops.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="same shape"):
        triton_ops.fused_add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"\(2, 7\)"):
        triton_ops.silu_and_mul(torch.randn(2, 7))
    q, k = torch.randn(2, 2, 6), torch.randn(2, 1, 6)
    cache = torch.zeros(3, 4, 1, 6)
    slots, positions = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1])
    with pytest.raises(
        ValueError, match=r"cos_sin_cache must be \[max_pos, 2, 6\], got \(8, 2, 4\)"
    ):
        triton_ops.rotary_and_cache_write(
            q, k, k, torch.zeros(8, 2, 4), positions, cache, cache, slots
        )
    with pytest.raises(ValueError, match=r"k_cache must be \[num_blocks, block_size, 1, 6\]"):
        triton_ops.rotary_and_cache_write(
            q, k, k, torch.zeros(8, 2, 6), positions, cache[..., :4], cache, slots
        )
    with pytest.raises(ValueError, match="even head_dim, got 5"):
        triton_ops.rotary_and_cache_write(
            q[..., :5],
            k[..., :5],
            k[..., :5],
            torch.zeros(8, 2, 5),
            positions,
            cache[..., :5],
            cache[..., :5],
            slots,
        )


def test_ops_are_registered_custom_ops_with_fake_impls():
    """opcheck: the schema's mutations are the real ones, and the fake impls give the right shapes."""
    hidden = 16
    x, residual, weight = torch.randn(3, hidden), torch.randn(3, hidden), torch.randn(hidden)
    torch.library.opcheck(torch.ops.kvserve.triton_rms_norm, (x, weight, 1e-6))
    torch.library.opcheck(torch.ops.kvserve.triton_fused_add_rms_norm, (x, residual, weight, 1e-6))
    torch.library.opcheck(torch.ops.kvserve.triton_silu_and_mul, (torch.randn(3, 2 * hidden),))
    q, k, v = torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    cache = torch.zeros(2, 4, 1, 8)
    torch.library.opcheck(
        torch.ops.kvserve.triton_rotary_and_cache_write,
        (
            q,
            k,
            v,
            rope(8, torch.float32),
            torch.tensor([1, 2]),
            cache,
            cache.clone(),
            torch.tensor([3, -1], dtype=torch.int32),
        ),
    )


def test_bench_kernels_elementwise_table_runs_on_the_cpu(capsys):
    """benchmarks/bench_kernels' GPU table, smoke-tested here with tiny sizes (timings are not checked)."""
    from benchmarks import bench_kernels

    results = bench_kernels.bench_elementwise(
        "cpu",
        rows=(1, 3),
        impls=("eager", "triton"),
        hidden=96,
        intermediate=40,
        dtype=torch.float32,
        calls=2,
    )
    assert [(op, rows, impl) for op, rows, impl, _ in results] == [
        (op, rows, impl)
        for rows in (1, 3)
        for op in ("add_rms_norm", "silu_and_mul")
        for impl in ("eager", "triton")
    ]
    out = capsys.readouterr().out
    assert "triton us (GB/s)" in out and out.count("silu_and_mul") == 2
    if not torch.cuda.is_available():
        assert bench_kernels.main(["--device", "cuda"]) == 1


def test_ops_trace_whole_under_torch_compile():
    """fullgraph: the wrappers' checks trace and the ops stay opaque, including in-place rotary of two
    views of one packed qkv buffer (aot_eager: the functionalized graph, no compiler needed)."""
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 64, 3
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    cos_sin_cache = rope(head_dim, torch.float32)
    weight = torch.randn(q_size)

    def layer(qkv, positions, k_cache, v_cache, slot_mapping):
        q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
        triton_ops.rotary_and_cache_write(
            q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping
        )
        out, residual = triton_ops.fused_add_rms_norm(
            q.reshape(num_tokens, q_size), torch.ones(num_tokens, q_size), weight, 1e-6
        )
        return (
            out
            + triton_ops.rms_norm(residual, weight, 1e-6)
            + triton_ops.silu_and_mul(qkv[:, : 2 * q_size])
        )

    qkv = torch.randn(num_tokens, q_size + 2 * kv_size)
    args = (torch.tensor([1, 5, 9]), torch.tensor([0, -1, 7], dtype=torch.int32))
    results = []
    for fn in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        buffer, k_cache, v_cache = (
            qkv.clone(),
            torch.zeros(2, 4, num_kv_heads, head_dim),
            torch.zeros(2, 4, 2, 64),
        )
        results.append((fn(buffer, args[0], k_cache, v_cache, args[1]), buffer, k_cache, v_cache))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


AOT_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvserve.models.kernels import triton_ops as K

def compile(fn, types, constexprs):
    names = list(fn.signature.parameters)
    signature = dict(zip(names, types + ["constexpr"] * len(constexprs)))
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))

bf16 = "*bf16"
compile(K._rms_norm_kernel, [bf16] * 4 + ["i32"] * 4 + ["fp32"],
        {"HAS_RESIDUAL": True, "ROUND_BEFORE_WEIGHT": True, "BLOCK": 4096})
compile(K._silu_and_mul_kernel, [bf16] * 2 + ["i32"] * 3, {"BLOCK": 1024})
for head_dim in (80, 128):
    half_pad = triton.next_power_of_2(head_dim // 2)
    compile(K._rotary_cache_kernel, [bf16] * 4 + ["*i64", bf16, bf16, "*i32"] + ["i32"] * 17,
            {"HALF": head_dim // 2, "HALF_PAD": half_pad, "HEAD_BLOCK": 1024 // half_pad})
print("compiled")
"""


def test_kernels_compile_for_a_gpu_without_one(tmp_path):
    """The interpreter runs Python, not the compiler: build the bf16 kernels for sm_90 (Triton's bundled
    ptxas, no GPU needed) so code that only fails in real compilation is caught here too."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", AOT_COMPILE],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    if "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("Triton's ptxas is not available here")
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
