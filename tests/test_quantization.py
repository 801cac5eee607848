"""Quantized weights (models/quantization.py, models/csrc/*/quant_linear.cpp, docs/quantization.md).

- formats: `quantize_int8` / `quantize_int4` are the gguf package's Q8_0 / Q4_0 blocks bit for
  bit (ties, zero groups), and the values of such blocks quantize back to the same blocks;
- the packed kernel layout round-trips (`unpack`, `rows`) for odd row counts and any group;
- `cpu_ops.quant_linear` equals `reference_linear` (its float64 definition) at batch 1,
  a few rows, prefill chunks, odd N and several groups, bf16 and fp32 (skipped without VNNI);
  the portable path (plain layout) equals x @ dequantized W.T everywhere;
- models: int8 / int4 serve every family, say so in `RuntimeInfo`, are smaller, and stay close to
  the unquantized model (KL divergence of the next-token distribution, greedy agreement);
- GGUF: a Q8_0 / Q4_0 file is held as its own blocks and serves exactly what the same values
  served from safetensors give;
- bad values are refused by name before weights load; prefix caching, structured outputs and
  preemption keep working on a quantized model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from checkpoints import make_checkpoint
from gguf_files import make_gguf
from kvserve import LLM, SamplingParams
from kvserve.engine.config import EngineArgs
from kvserve.models import cpu_ops
from kvserve.models import loader as loader_module
from kvserve.models.attention import Attention
from kvserve.models.gguf_loader import _unpermute, iter_gguf_tensors
from kvserve.models.hf_config import load_hf_config
from kvserve.models.layers import Linear, VocabEmbedding
from kvserve.models.loader import load_model
from kvserve.models.quantization import (
    QuantizedLinear,
    QuantizedWeight,
    _roundf,
    dequantize,
    has_kernels,
    quantize_int4,
    quantize_int8,
    reference_linear,
)
from test_models import PagedRunner, make_prompts

KERNELS = cpu_ops.load() and has_kernels()
needs_kernels = pytest.mark.usefixtures("kernel_set")  # once per CPU kernel set this machine runs

Q8_0, Q4_0 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
QTYPE = {8: Q8_0, 4: Q4_0}
QUANTIZE = {8: quantize_int8, 4: quantize_int4}
METHOD_BITS = {"int8": 8, "int4": 4}


# ---- formats --------------------------------------------------------------------------------------------


def parse_blocks(raw: np.ndarray, qtype, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A gguf Q8_0 / Q4_0 tensor's bytes [n, k / 32 * block bytes] -> (q int8 [n, k], d float16 [n, k / 32])."""
    blocks = np.ascontiguousarray(raw).reshape(-1, 34 if qtype == Q8_0 else 18)
    d = blocks[:, :2].copy().view(np.float16)
    if qtype == Q8_0:
        q = blocks[:, 2:].copy().view(np.int8)
    else:  # element i in the low nibble of byte i, element 16 + i in its high nibble
        nibbles = blocks[:, 2:]
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=1).astype(np.int8) - 8
    return torch.from_numpy(q.reshape(n, k).copy()), torch.from_numpy(d.reshape(n, k // 32).copy())


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype == torch.float16:
        got, want = got.view(torch.int16), want.view(torch.int16)
    assert torch.equal(got, want), what


def weight_cases() -> list[np.ndarray]:
    """[N, K] float32 weights: random at several scales, a zero group, and groups with values
    exactly at (and one ulp either side of) the rounding ties of both formats."""
    rng = np.random.default_rng(0)
    cases = [rng.standard_normal((37, 256)).astype(np.float32) * s for s in (0.02, 1.0, 300.0)]
    with_zero = rng.standard_normal((3, 128)).astype(np.float32)
    with_zero[1, 32:64] = 0  # a zero group (scale 0)
    with_zero[2, :32] = (
        rng.uniform(-1, 1, 32) * 1e-5
    )  # a tiny group: its scale is an fp16 subnormal
    cases.append(with_zero)
    # int8 ties: max |w| 127 makes d = 1 and w / d = w, so a half-integer w is an exact tie
    # (half away from zero: 2.5 -> 3, -2.5 -> -3); d = 0.25 likewise with w = (k + 0.5) / 4.
    halves = np.arange(-126.5, 127.0, 1.0, dtype=np.float32)
    near = np.concatenate(
        [
            halves,
            np.nextafter(halves, np.float32(np.inf)),
            np.nextafter(halves, np.float32(-np.inf)),
        ]
    )
    # (the two values 0.49999997 and -0.49999997 are left to test_int8_just_below_half)
    near = near[np.abs(near) != np.nextafter(np.float32(0.5), np.float32(0))]
    near = np.concatenate([near, np.zeros(-len(near) % 31, np.float32)])
    groups = near.reshape(-1, 31)
    int8_ties = np.concatenate([np.full((len(groups), 1), 127.0, np.float32), groups], axis=1)
    int8_ties[1::2, 0] = -127.0
    cases.append(int8_ties)
    cases.append(
        np.concatenate([np.full((len(groups), 1), 31.75, np.float32), groups / 4], axis=1).reshape(
            -1, 32
        )
    )
    # int4 ties: the extreme -8 makes d = 1 (and +8: d = -1), w / d + 8.5 is whole at w = k + 0.5,
    # and 7.5 lands on 16, clipped to 15.
    fours = np.arange(-7.5, 8.0, 1.0, dtype=np.float32)
    fours = (
        np.concatenate(
            [
                fours,
                np.nextafter(fours, np.float32(np.inf)),
                np.nextafter(fours, np.float32(-np.inf)),
                [0.0, 0.0],
            ]
        )
        .astype(np.float32)
        .reshape(-1, 25)
    )
    for extreme in (-8.0, 8.0):
        rows = np.concatenate(
            [
                np.full((2, 1), extreme, np.float32),
                fours,
                np.full((2, 6), -extreme / 2, np.float32),
            ],
            axis=1,
        )
        cases.append(rows)
    return cases


@pytest.mark.parametrize("bits", [8, 4])
def test_formats_are_gguf_blocks_bit_for_bit(bits):
    qtype, quantize = QTYPE[bits], QUANTIZE[bits]
    for i, w in enumerate(weight_cases()):
        n, k = w.shape
        raw = gguf.quants.quantize(w, qtype)
        want_q, want_d = parse_blocks(raw, qtype, n, k)
        q, d = quantize(torch.from_numpy(w), 32)
        assert_same_bits(q, want_q, f"case {i}: q")
        assert_same_bits(d, want_d, f"case {i}: d")
        assert int(q.min()) >= (-127 if bits == 8 else -8) and int(q.max()) <= (
            127 if bits == 8 else 7
        )
        values = gguf.quants.dequantize(raw, qtype)
        assert torch.equal(dequantize(q, d, 32), torch.from_numpy(values)), f"case {i}"
        # a file's values quantize back to its blocks (what makes serving a GGUF file exact);
        # an all-zero Q4_0 group's scale may come back as +0.0 for -0.0: compared as values
        q2, d2 = quantize(torch.from_numpy(values), 32)
        assert torch.equal(q2, q) and torch.equal(d2, d), f"case {i}"
        if bits == 8:
            assert_same_bits(d2, d, f"case {i}: d again")


def test_format_rounding_rules_at_ties():
    """The documented rules on hand-checked values: int8 rounds half away from zero; int4
    truncates w / d + 8.5 (ties go up) and clips 7.5 to 7."""
    w = torch.zeros(1, 32)
    w[0, :6] = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5, 126.5])
    q, d = quantize_int8(w)
    assert d.item() == 1.0 and q[0, :6].tolist() == [127, 3, -3, 1, -1, 127]
    w[0, :6] = torch.tensor([-8.0, 2.5, -2.5, 7.5, -7.5, 0.5])
    q, d = quantize_int4(w)
    assert d.item() == 1.0 and q[0, :6].tolist() == [-8, 3, -2, 7, -7, 1]
    q, d = quantize_int4(torch.zeros(2, 64))
    assert not q.any() and not d.any()


def test_int8_just_below_half():
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = (
        127.0,
        np.nextafter(np.float32(0.5), np.float32(0)),
    )  # d = 1: w / d = 0.49999997
    want_q, _ = parse_blocks(gguf.quants.quantize(w, Q8_0), Q8_0, 1, 32)
    q, _ = quantize_int8(torch.from_numpy(w))
    assert q[0, 1].item() == want_q[0, 1].item() == 0


def test_roundf_is_c_roundf_in_fp32():
    """`_roundf` (fp32 arithmetic) equals the fp64 definition trunc(x + 0.5 sign(x)) bit for bit,
    sign of zero included: ties, one ulp either side of them, 0.49999997, zeros, large and
    non-finite values, and random ones."""
    halves = torch.arange(-400, 401, dtype=torch.float32) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    special = [0.49999997, -0.49999997, 0.5, -0.5, 1.5, 2.5, -2.5, 0.0, -0.0, 1e-45, -1e-45]
    special += [2.0**23 - 0.5, -(2.0**23 - 0.5), 2.0**23 + 1, 2.0**24, 3e38, -3e38]
    x = torch.cat(
        [
            halves,
            torch.nextafter(halves, up),
            torch.nextafter(halves, down),
            torch.tensor(special + [float("inf"), float("-inf")]),
            torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 200,
        ]
    )
    y = x.double()
    want = y.add(torch.full_like(y, 0.5).copysign(x)).trunc()
    got = _roundf(x)
    assert got.dtype == torch.float32
    assert torch.equal(got.double(), want) and torch.equal(got.signbit(), want.signbit())
    assert _roundf(torch.tensor([float("nan")])).isnan().all()
    assert _roundf(torch.tensor(special[:7])).tolist() == [0, -0, 1, -1, 2, 3, -3]


def q4_0_any_group(w: np.ndarray, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf's Q4_0 `quantize_blocks` arithmetic for blocks of `group` (without the nibble packing)."""
    blocks = w.reshape(-1, group)
    m = np.take_along_axis(blocks, abs(blocks).argmax(axis=-1, keepdims=True), axis=-1)
    d = m / -8
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, 0, 1 / d)
    u = np.trunc((blocks * inv) + np.float32(8.5), dtype=np.float32).astype(np.uint8).clip(0, 15)
    q = u.astype(np.int8) - 8
    return torch.from_numpy(q.reshape(w.shape)), torch.from_numpy(
        d.astype(np.float16).reshape(w.shape[0], -1)
    )


def q8_0_any_group(w: np.ndarray, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf's own Q8_0 `quantize_blocks` on blocks of `group` (it does not depend on 32)."""
    raw = gguf.quants.Q8_0.quantize_blocks(w.reshape(-1, group))
    q = raw[:, 2:].copy().view(np.int8).reshape(w.shape)
    return torch.from_numpy(q), torch.from_numpy(
        raw[:, :2].copy().view(np.float16).reshape(w.shape[0], -1)
    )


@pytest.mark.parametrize("group", [16, 32, 48, 64, 128])
def test_formats_any_group(group):
    """Other group sizes follow the same rules (gguf's arithmetic on blocks of that size)."""
    rng = np.random.default_rng(group)
    w = rng.standard_normal((11, 384)).astype(np.float32) * 0.05
    w[3, :group] = 0
    for bits, rule in ((8, q8_0_any_group), (4, q4_0_any_group)):
        want_q, want_d = rule(w, group)
        q, d = QUANTIZE[bits](torch.from_numpy(w), group)
        assert_same_bits(q, want_q, f"int{bits} q")
        assert_same_bits(d, want_d, f"int{bits} d")
        if group == 32:  # the Q4_0 copy above is gguf's, exactly
            assert_same_bits(
                want_q, parse_blocks(gguf.quants.quantize(w, QTYPE[bits]), QTYPE[bits], 11, 384)[0]
            )
        # half a step (int4: a whole step where w / d passes 7.5 and clips), plus q times d's fp16 rounding
        # (q is rounded with the fp32 scale, as llama.cpp does)
        err = (dequantize(q, d, group) - torch.from_numpy(w)).abs()
        bound = 0.5 + 127 * 2.0**-11 if bits == 8 else 1 + 8 * 2.0**-11
        assert bool((err <= d.float().abs().repeat_interleave(group, 1) * bound).all())


def test_format_refuses_a_group_that_does_not_divide():
    with pytest.raises(ValueError, match="does not split into groups of 48"):
        quantize_int8(torch.zeros(4, 64), 48)


# ---- packing --------------------------------------------------------------------------------------------


def random_int(
    bits: int, n: int, k: int, group: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-127, 128) if bits == 8 else (-8, 8)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    q[0, 0], q[-1, -1] = lo, hi - 1  # the extremes of the range
    d = (torch.rand(n, k // group, generator=g) * 0.1 + 1e-3).to(torch.float16)
    d[n // 2, 0] = -d[n // 2, 0]  # Q4_0 scales are often negative
    return q, d


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1, 64, 100, 130])
@pytest.mark.parametrize("k,group", [(96, 32), (256, 64), (48, 16), (144, 48)])
def test_packed_layout_round_trips(bits, n, k, group):
    q, d = random_int(bits, n, k, group, seed=n + k)
    packed = QuantizedWeight.from_int(q, d, bits, group, packed=True)
    plain = QuantizedWeight.from_int(q, d, bits, group, packed=False)
    assert (
        packed.packed and not plain.packed and (packed.n, packed.k) == (plain.n, plain.k) == (n, k)
    )
    blocks = -(-n // 64)
    assert (
        packed.data.shape == (blocks, k // 4, 256 if bits == 8 else 128)
        and packed.data.dtype == torch.uint8
    )
    assert packed.scales.shape == (blocks, k // group, 64) and packed.scales.dtype == torch.float16
    assert packed.nbytes == blocks * 64 * (k * bits // 8 + k // group * 2)
    for weight in (packed, plain):
        got_q, got_d = weight.unpack()
        assert_same_bits(got_q, q)
        assert_same_bits(got_d, d)
    ids = torch.tensor([n - 1, 0, n // 2, n - 1, min(63, n - 1)])
    full = dequantize(q, d, group)
    for dtype in (torch.float32, torch.bfloat16):
        rows = packed.rows(ids, dtype)
        assert rows.dtype == dtype and torch.equal(rows, full[ids].to(dtype))
        assert torch.equal(plain.rows(ids, dtype), rows)
    got_q, got_d = packed.unpack_rows(ids)
    assert torch.equal(got_q, q[ids]) and torch.equal(got_d, d[ids])


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_packed_and_plain_hold_the_same_matrix(bits):
    w = torch.randn(130, 192) * 0.05
    packed = QuantizedWeight.quantize(w, bits, 64, packed=True)
    plain = QuantizedWeight.quantize(w, bits, 64, packed=False)
    want = QUANTIZE[bits](w, 64)
    for weight in (packed, plain):
        assert weight.bits == bits and weight.group == 64
        for got, expected in zip(weight.unpack(), want):
            assert_same_bits(got, expected)


# ---- the matmul -----------------------------------------------------------------------------------------


def make_linear(n: int, k: int, group: int, bits: int, bias: bool, packed: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    return QuantizedLinear(QuantizedWeight.quantize(w, bits, group, packed), b), b


def make_x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if m > 2:
        x[1] = 0  # a zero row: activation scale 0
        x[2, 0] = 40.0  # an outlier: the rest of its group rounds coarsely
    return x


def assert_matches_reference(y: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: within 1e-5 of the output's largest magnitude; bf16: within one bf16 rounding."""
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (y.double() - ref).abs()
    bound = 1e-5 * scale + (2.0**-8 * ref.abs() if y.dtype == torch.bfloat16 else 0.0)
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g} (output max {scale:.3g})"


KERNEL_CASES = [  # (M, N, K, group, bits, bias)
    (1, 100, 96, 32, 8, True),
    (1, 130, 256, 64, 4, False),
    (2, 64, 128, 32, 4, True),
    (3, 100, 192, 64, 8, False),
    (5, 130, 96, 32, 8, True),
    (5, 1, 64, 16, 4, True),
    (7, 70, 144, 48, 8, True),
    (97, 130, 128, 32, 4, True),
    (97, 64, 256, 64, 8, False),
    (300, 200, 96, 32, 8, True),
    (300, 100, 192, 64, 4, True),
]


@needs_kernels
@pytest.mark.parametrize("m,n,k,group,bits,bias", KERNEL_CASES)
def test_kernel_matches_reference(m, n, k, group, bits, bias):
    lin, b = make_linear(n, k, group, bits, bias, packed=True, seed=m + n)
    x = make_x(m, k)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        y = lin(xd)
        assert y.shape == (m, n) and y.dtype == dtype
        assert_matches_reference(y, reference_linear(xd, lin.weight, b))
    # the bf16 output is the fp32 output rounded once (the same arithmetic on the same values)
    xb = x.bfloat16()
    assert torch.equal(lin(xb), lin(xb.float()).bfloat16())
    # each row is its own: the same bits whatever the batch around it
    y = lin(xb)
    for i in sorted({0, m // 2, m - 1}):
        assert torch.equal(lin(xb[i : i + 1])[0], y[i])


@needs_kernels
def test_kernel_empty_strided_and_3d_inputs():
    lin, b = make_linear(100, 128, 32, 8, True, packed=True)
    for dtype in (torch.float32, torch.bfloat16):
        empty = lin(torch.zeros(0, 128, dtype=dtype))
        assert empty.shape == (0, 100) and empty.dtype == dtype
        wide = make_x(9, 200).to(dtype)
        x = wide[:, 40:168]  # rows 200 apart
        assert x.stride() == (200, 1)
        assert torch.equal(lin(x), lin(x.contiguous()))
        xt = x.contiguous().t().contiguous().t()  # column-major: copied first
        assert xt.stride(-1) != 1 and torch.equal(lin(xt), lin(x.contiguous()))
        x3 = make_x(12, 128).to(dtype).view(3, 4, 128)
        y3 = lin(x3)
        assert y3.shape == (3, 4, 100) and torch.equal(y3, lin(x3.reshape(12, 128)).view(3, 4, 100))
        assert_matches_reference(
            y3.reshape(12, 100), reference_linear(x3.reshape(12, 128), lin.weight, b)
        )


@needs_kernels
def test_kernel_refuses_mismatched_input():
    lin, _ = make_linear(64, 128, 32, 8, False, packed=True)
    with pytest.raises(RuntimeError, match="features"):
        lin(torch.zeros(2, 96))
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        cpu_ops.quant_linear(
            torch.zeros(2, 128, dtype=torch.float16),
            lin.weight.data,
            lin.weight.scales,
            None,
            64,
            8,
            32,
        )
    y = lin(torch.ones(2, 128, dtype=torch.float16))  # fp16 goes through fp32
    assert y.dtype == torch.float16 and torch.equal(y, lin(torch.ones(2, 128)).half())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "m,n,k,group,bias", [(1, 100, 96, 32, True), (5, 130, 256, 64, False), (40, 64, 144, 48, True)]
)
def test_portable_path_is_weight_only(bits, m, n, k, group, bias):
    """packed=False (no VNNI, CUDA): x @ dequantized W.T (+ bias), no activation rounding."""
    lin, b = make_linear(n, k, group, bits, bias, packed=False)
    q, d = lin.weight.unpack()
    x = make_x(m, k)
    want = x.double() @ dequantize(q, d, group).double().T + (0 if b is None else b.double())
    y = lin(x)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, atol=1e-5 * want.abs().max().item(), rtol=0)
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    assert lin(torch.zeros(0, k)).shape == (0, n)
    if KERNELS:  # the kernel adds the activation rounding: close, not equal
        fast, _ = make_linear(n, k, group, bits, bias, packed=True)
        torch.testing.assert_close(fast(x), y, atol=0.02 * want.abs().max().item(), rtol=0)


# ---- models ---------------------------------------------------------------------------------------------


FAMILIES = ("llama", "llama-tied", "qwen3", "gpt2")
PROMPT_LENS = [1, 2, 5, 9, 17, 33, 50]


@pytest.fixture(scope="module")
def model_dirs(checkpoint_dirs, tmp_path_factory) -> dict[str, str]:
    tied = make_checkpoint(
        tmp_path_factory.mktemp("quant") / "llama-tied", "llama", tie_word_embeddings=True
    )
    return {
        "llama": checkpoint_dirs["llama"],
        "llama-tied": tied,
        "qwen3": checkpoint_dirs["qwen3"],
        "gpt2": checkpoint_dirs["gpt2"],
    }


def load(path: str, dtype: torch.dtype, quantization: str | None, **kw) -> torch.nn.Module:
    return load_model(path, load_hf_config(path), dtype, "cpu", quantization=quantization, **kw)


def logits_of(model: torch.nn.Module, prompts: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Logits at every prompt position [positions, vocab] (the prompts in one batch)."""
    runner = PagedRunner(model, block_size=4)
    for module in (
        model.modules()
    ):  # PagedRunner takes the first parameter's dtype: a quantized one may be fp32
        if isinstance(module, Attention):
            module.kv_cache = module.kv_cache.to(dtype)
    return torch.cat(runner.step([(i, p, 0) for i, p in enumerate(prompts)])).float()


def quantized_layers(model: torch.nn.Module) -> dict[str, QuantizedWeight]:
    held = {
        name: m.packed.weight
        for name, m in model.named_modules()
        if isinstance(m, Linear) and isinstance(m.packed, QuantizedLinear)
    }
    held |= {
        name: m.quantized
        for name, m in model.named_modules()
        if isinstance(m, VocabEmbedding) and m.quantized is not None
    }
    return held


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || quantized) per position."""
    ref, lp = ref_logits.double().log_softmax(-1), logits.double().log_softmax(-1)
    return (ref.exp() * (ref - lp)).sum(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_models_stay_close(model_dirs, family):
    """Next-token distributions against the unquantized bf16 model at every prompt position.
    Measured on these checkpoints (whose distributions are nearly flat): int8 KL mean 4-6e-5, max
    ~1e-4, greedy agreement 95-99%; int4 KL mean 3-5e-3, max <= 1.8e-2, 68-80%. (bf16 itself is
    ~1e-5 from fp32.)"""
    path = model_dirs[family]
    prompts = make_prompts(384, PROMPT_LENS, seed=1)
    ref = logits_of(load(path, torch.bfloat16, "none"), prompts, torch.bfloat16)
    stats = {}
    for method in ("int8", "int4"):
        model = load(path, torch.bfloat16, method)
        held = quantized_layers(model)
        num_matrices = len([m for m in model.modules() if isinstance(m, Linear)]) + (
            family in ("llama-tied", "gpt2")
        )
        assert len(held) == num_matrices == model.weights_report.quantized_layers
        for name, weight in held.items():  # the LM head (or the tied embedding) is int8 under both
            head = name.endswith("lm_head") or name.endswith(("embed_tokens", "wte"))
            assert weight.bits == (8 if head else METHOD_BITS[method]), name
            assert weight.group == 32 and weight.packed == KERNELS, name
        logits = logits_of(model, prompts, torch.bfloat16)
        kl = kl_divergence(ref, logits)
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        stats[method] = kl.mean().item(), kl.max().item(), agree
    (kl8, kl8_max, agree8), (kl4, kl4_max, agree4) = stats["int8"], stats["int4"]
    assert 0 < kl8 < 3e-4 and kl8_max < 1e-3, stats
    assert kl4 < 3e-2 and kl4_max < 8e-2, stats
    assert kl4 > 10 * kl8, stats  # int4 is really coarser
    assert agree8 >= 0.85 and agree4 >= 0.4, stats


@pytest.mark.parametrize("family", ["llama-tied", "qwen3", "gpt2"])
def test_fp8_model_is_fp8_everywhere_and_stays_close(model_dirs, family, caplog):
    """fp8 (for GPUs) on the CPU's portable path: every matrix and the LM head (a tied embedding too)
    held as e4m3 with fp16 group scales, about half of bf16's bytes, with a warning that nothing here
    multiplies it fast. Measured on these checkpoints: KL mean 3.4-5.6e-4, max <= 1.3e-3 (between int8's
    and int4's: e4m3 keeps 3 mantissa bits)."""
    path = model_dirs[family]
    prompts = make_prompts(384, PROMPT_LENS, seed=1)
    ref_model = load(path, torch.bfloat16, "none")
    ref = logits_of(ref_model, prompts, torch.bfloat16)
    with caplog.at_level("WARNING", logger="kvserve.models.quantization"):
        model = load(path, torch.bfloat16, "fp8")
    assert "no CPU kernel" in caplog.text
    held = quantized_layers(model)
    assert held and all(w.fp8 and w.bits == 8 and not w.packed for w in held.values())
    report = model.weights_report
    assert report.method == "fp8" and "LM head fp8" in report.describe()
    assert report.weight_bytes < 0.7 * ref_model.weights_report.weight_bytes
    kl = kl_divergence(ref, logits_of(model, prompts, torch.bfloat16))
    assert 0 < kl.mean().item() < 2e-3 and kl.max().item() < 5e-3, (
        kl.mean().item(),
        kl.max().item(),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_llm_reports_quantization_and_weight_bytes(model_dirs, family):
    path = model_dirs[family]
    prompts = make_prompts(384, [3, 4, 5, 6, 7, 8, 9, 11, 13, 16, 20, 24], seed=2)
    greedy = SamplingParams(max_tokens=1, temperature=0, logprobs=2)
    info, first = {}, {}
    for method in ("none", "int8", "int4"):
        llm = LLM(model=path, quantization=method, dtype="bfloat16", device="cpu")
        try:
            info[method] = llm.engine.info
            assert llm.engine.runner.model.weights_report.weight_bytes == info[method].weight_bytes
            if KERNELS and method != "none":  # the kernels' matrices in one huge-page arena
                held = quantized_layers(llm.engine.runner.model).values()
                assert len({w.data.untyped_storage().data_ptr() for w in held}) == 1
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
            first[method] = [o.outputs[0].token_ids[0] for o in outs]
        finally:
            llm.shutdown()
    for method in info:
        assert info[method].quantization == method and info[method].dtype == "bfloat16"
    none, int8, int4 = (info[m].weight_bytes for m in ("none", "int8", "int4"))
    assert int8 < 0.7 * none
    if KERNELS:  # the portable path holds int4 values in int8 (docs/quantization.md)
        assert int4 < 0.85 * int8
    same = sum(a == b for a, b in zip(first["int8"], first["none"]))
    assert same >= len(prompts) - 3, (first["int8"], first["none"])


def test_other_group_sizes_serve(tmp_path):
    """Groups of 48 and 96 go through load and the kernel too (hidden 192, intermediate 384)."""
    path = make_checkpoint(tmp_path / "g48", "llama", hidden_size=192, intermediate_size=384)
    prompts = make_prompts(384, [5, 12], seed=3)
    ref = logits_of(load(path, torch.bfloat16, "none"), prompts, torch.bfloat16)
    for group in (48, 96):
        model = load(path, torch.bfloat16, "int8", quantization_group_size=group)
        assert {w.group for w in quantized_layers(model).values()} == {group}
        assert model.weights_report.group_size == group
        assert kl_divergence(ref, logits_of(model, prompts, torch.bfloat16)).max() < 1e-3


# ---- GGUF -----------------------------------------------------------------------------------------------


LLAMA_BLOCK = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {t: make_gguf(root / t, "llama", t) for t in ("Q8_0", "Q4_0")}


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0"])
def test_gguf_is_held_as_its_own_blocks(gguf_files, tensor_type):
    """Served as it comes (bf16 model), every layer matrix holds the file's (q, d); the LM head is
    int8 (the file's blocks from Q8_0, the int8 of its values from Q4_0); the untied embedding
    holds the file's values in bf16."""
    path = gguf_files[tensor_type]
    qtype = gguf.GGMLQuantizationType[tensor_type]
    bits = 8 if tensor_type == "Q8_0" else 4
    model = load(str(path), torch.bfloat16, None)
    assert model.weights_report.method == ("int8" if bits == 8 else "int4")
    file = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def blocks(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        t = file[name]
        n, k = (int(s) for s in reversed(t.shape))
        q, d = parse_blocks(t.data, qtype, n, k)
        if name.endswith(("attn_q.weight", "attn_k.weight")):  # llama.cpp's rotary row order
            heads = 4 if "attn_q" in name else 2
            q, d = _unpermute(q, heads), _unpermute(d, heads)
        return q, d

    held = quantized_layers(model)
    for i in range(2):
        for module, names in LLAMA_BLOCK.items():
            parts = [blocks(f"blk.{i}.{name}.weight") for name in names]
            weight = held[f"model.layers.{i}.{module}"]
            assert weight.bits == bits
            q, d = weight.unpack()
            assert_same_bits(q, torch.cat([p[0] for p in parts]), module)
            assert_same_bits(d, torch.cat([p[1] for p in parts]), module)
    head = held["lm_head"]
    assert head.bits == 8
    if bits == 8:
        want = blocks("output.weight")
    else:
        values = torch.from_numpy(gguf.quants.dequantize(file["output.weight"].data, qtype).copy())
        want = quantize_int8(values)
    for got, expected in zip(head.unpack(), want):
        assert_same_bits(got, expected)
    emb = model.model.embed_tokens.weight
    values = gguf.quants.dequantize(file["token_embd.weight"].data, qtype).copy()
    assert emb.dtype == torch.bfloat16 and torch.equal(
        emb, torch.from_numpy(values).to(torch.bfloat16)
    )


@pytest.mark.parametrize(
    "tensor_type,method", [("Q4_K_M", "int4"), ("Q6_K", "int8"), ("Q5_0", "int8")]
)
def test_k_quant_file_is_held_with_at_least_its_bits(tmp_path, tensor_type, method):
    """Served as it comes, a Q4_K_M file is int4 but its Q6_K matrices (value, FFN down, head) stay
    int8; Q6_K and Q5_0 files are int8. The held weights are re-quantized from the file's exact
    values, within a step of them (about half a step in int8), and not equal to them: K-quant and Q5_0
    blocks are not Q8_0 / Q4_0 blocks (docs/quantization.md)."""
    path = make_gguf(tmp_path, "llama", tensor_type, hidden_size=256, intermediate_size=256)
    model = load(str(path), torch.float32, None)
    assert model.weights_report.method == method
    values = dict(iter_gguf_tensors(path))  # the file's exact values under HF names
    held = quantized_layers(model)
    wide = {"self_attn.qkv_proj", "mlp.down_proj"} if tensor_type == "Q4_K_M" else set(LLAMA_BLOCK)
    parts = {
        "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "self_attn.o_proj": ("o_proj",),
        "mlp.gate_up_proj": ("gate_proj", "up_proj"),
        "mlp.down_proj": ("down_proj",),
    }
    for i in range(2):
        for module, names in parts.items():
            weight = held[f"model.layers.{i}.{module}"]
            assert weight.bits == (8 if module in wide or method == "int8" else 4), module
            want = torch.cat(
                [values[f"model.layers.{i}.{module.split('.')[0]}.{n}.weight"] for n in names]
            )
            q, d = weight.unpack()
            step = d.float().abs().repeat_interleave(weight.group, dim=1)
            error = (q.float() * d.float().repeat_interleave(weight.group, dim=1) - want).abs()
            # half a step (int8; int4's clamp at 7: a step), plus the fp16 rounding of the scale (values
            # are rounded against the unrounded scale, as in llama.cpp's Q8_0 / Q4_0): 2^-11 per level
            bound = 0.5 + 127 / 2048 if weight.bits == 8 else 1 + 8 / 2048
            assert (error <= step * bound * (1 + 1e-4)).all(), module
            assert error.max() > 0, module
    assert held["lm_head"].bits == 8


def checkpoint_of_file_values(gguf_path: Path, hf_dir: Path, out: Path) -> str:
    """A safetensors checkpoint holding exactly a GGUF file's (dequantized) values."""
    out.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_file(
        {name: w.contiguous() for name, w in iter_gguf_tensors(gguf_path)},
        str(out / "model.safetensors"),
    )
    return str(out)


def generate(path: str, prompts: list[list[int]], **kw):
    llm = LLM(model=path, device="cpu", block_size=4, **kw)
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return llm.engine.info, [
            (
                o.outputs[0].token_ids,
                [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
            )
            for o in outs
        ]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tensor_type,method", [("Q8_0", "int8"), ("Q4_0", "int4")])
def test_gguf_serves_what_its_values_serve_from_safetensors(
    gguf_files, tmp_path, tensor_type, method
):
    """fp32: the file served as it comes == a safetensors copy of its values with quantization=method,
    token for token and logprob for logprob."""
    path = gguf_files[tensor_type]
    copy = checkpoint_of_file_values(path, path.parent / "hf", tmp_path / "values")
    prompts = make_prompts(384, [1, 7, 19], seed=4)
    info_gguf, got = generate(str(path), prompts, dtype="float32")
    info_st, want = generate(copy, prompts, dtype="float32", quantization=method)
    assert info_gguf.quantization == info_st.quantization == method
    assert got == want
    assert torch.equal(
        logits_of(load(str(path), torch.float32, None), prompts, torch.float32),
        logits_of(load(copy, torch.float32, method), prompts, torch.float32),
    )


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_q8_0_gguf_equals_int8_of_its_checkpoint(tmp_path, family):
    """Q8_0 of a checkpoint is its int8: a tied fp32 model from the Q8_0 file and from the
    safetensors checkpoint it was made from (quantization="int8") give the same logits bit for
    bit. (Untied, the file's embedding is Q8_0-valued and the checkpoint's is not; in bf16 the
    checkpoint is quantized from its bf16-rounded weights.)"""
    overrides = {} if family == "gpt2" else dict(tie_word_embeddings=True)
    path = make_gguf(tmp_path, family, "Q8_0", **overrides)
    prompts = make_prompts(384, [1, 6, 21], seed=5)
    from_file = logits_of(load(str(path), torch.float32, None), prompts, torch.float32)
    from_checkpoint = logits_of(
        load(str(tmp_path / "hf"), torch.float32, "int8"), prompts, torch.float32
    )
    assert torch.equal(from_file, from_checkpoint)
    if family == "llama":  # end to end as well
        assert (
            generate(str(path), prompts, dtype="float32")[1]
            == generate(str(tmp_path / "hf"), prompts, dtype="float32", quantization="int8")[1]
        )


def test_resolve_quantization(gguf_files, tmp_path, llama_dir):
    assert loader_module.resolve_quantization(None, str(gguf_files["Q8_0"])) == "int8"
    assert loader_module.resolve_quantization(None, str(gguf_files["Q4_0"])) == "int4"
    assert loader_module.resolve_quantization(None, llama_dir) == "none"
    assert loader_module.resolve_quantization("int4", str(gguf_files["Q8_0"])) == "int4"
    assert loader_module.resolve_quantization("none", str(gguf_files["Q8_0"])) == "none"
    for tensor_type in ("F32", "F16", "BF16"):
        assert (
            loader_module.resolve_quantization(
                None, str(make_gguf(tmp_path / tensor_type, "llama", tensor_type))
            )
            == "none"
        )
    for tensor_type, method in (("Q6_K", "int8"), ("Q4_K", "int4")):  # 256-wide blocks
        path = make_gguf(
            tmp_path / tensor_type, "llama", tensor_type, hidden_size=256, intermediate_size=256
        )
        assert loader_module.resolve_quantization(None, str(path)) == method


def test_gguf_with_quantization_none_is_unquantized(gguf_files):
    path = gguf_files["Q8_0"]
    model = load(str(path), torch.bfloat16, "none")
    assert model.weights_report.method == "none" and not quantized_layers(model)
    file = {t.name: t for t in gguf.GGUFReader(path).tensors}
    values = torch.from_numpy(
        gguf.quants.dequantize(file["blk.0.ffn_down.weight"].data, Q8_0).copy()
    )
    fp32 = load(str(path), torch.float32, "none")  # fp32 keeps the plain weight (bf16 repacks it)
    assert torch.equal(fp32.model.layers[0].mlp.down_proj.weight, values)
    info, _ = generate(str(path), [[5, 6, 7]], dtype="bfloat16", quantization="none")
    info8, _ = generate(str(path), [[5, 6, 7]], dtype="bfloat16")
    assert info.quantization == "none" and info8.quantization == "int8"
    assert info8.weight_bytes < 0.7 * info.weight_bytes


# ---- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["int3", "fp4", "INT8", ""])
def test_unknown_method_is_refused_by_name(value, llama_dir):
    with pytest.raises(
        ValueError, match=f"quantization '{value}' is not supported.*none, int8, int4, fp8"
    ):
        EngineArgs(model=llama_dir, quantization=value).validate()
    with pytest.raises(ValueError, match=f"'{value}'"):
        LLM(model=llama_dir, quantization=value, device="cpu")


@pytest.mark.parametrize("group", [0, 24, -32, 8, True, 32.0])
def test_bad_group_size_is_refused(group, llama_dir):
    with pytest.raises(
        ValueError,
        match=f"quantization_group_size must be a positive multiple of 16, got {group!r}",
    ):
        EngineArgs(quantization="int8", quantization_group_size=group).validate()
    with pytest.raises(ValueError, match="quantization_group_size"):
        LLM(model=llama_dir, quantization="int8", quantization_group_size=group, device="cpu")


def test_cli_flags_reach_engine_args_and_are_checked():
    from test_cli_options import _config_from, _serve_subparser

    config = _config_from(
        _serve_subparser(), ["--quantization", "int4", "--quantization-group-size", "64"]
    )
    args = EngineArgs(**config.engine_kwargs())
    assert (args.quantization, args.quantization_group_size) == ("int4", 64)
    with pytest.raises(ValueError, match="--quantization"):
        _config_from(_serve_subparser(), ["--quantization", "int3"])
    with pytest.raises(ValueError, match="multiple of 16, got 24"):
        _config_from(_serve_subparser(), ["--quantization-group-size", "24"])


@pytest.mark.parametrize(
    "overrides,layer,features",
    [
        (dict(), "model.layers.0.self_attn.qkv_proj", 64),
        (dict(hidden_size=96, intermediate_size=128), "model.layers.0.mlp.down_proj", 128),
    ],
)
def test_group_that_does_not_divide_is_refused_before_weights_load(
    tmp_path, monkeypatch, overrides, layer, features
):
    path = make_checkpoint(tmp_path / "m", "llama", **overrides)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the group size was checked")

    monkeypatch.setattr(loader_module, "load_weights", no_weights)
    with pytest.raises(
        ValueError,
        match=rf"cannot quantize {layer} in groups of 48: it has {features} input features",
    ):
        LLM(model=path, quantization="int4", quantization_group_size=48, device="cpu")
    with pytest.raises(
        AssertionError, match="weights were read"
    ):  # unquantized, the group is not used
        LLM(model=path, quantization_group_size=48, device="cpu")


def test_gguf_with_unsupported_tensor_type_still_errors(tmp_path):
    path = make_gguf(
        tmp_path, "llama", "MXFP4"
    )  # a type the gguf package writes and kvserve does not read
    assert loader_module.resolve_quantization(None, str(path)) == "none"
    for method in (None, "int8"):
        with pytest.raises(
            ValueError,
            match=r"GGUF tensor '[a-z_.0-9]+weight' has type MXFP4.*supported tensor types",
        ):
            LLM(model=str(path), quantization=method, device="cpu")


@needs_kernels
def test_float16_model_with_quantization(llama_dir):
    try:
        llm = LLM(model=llama_dir, quantization="int8", dtype="float16", device="cpu")
    except ValueError as e:  # refusing the combination up front would do too
        assert "float16" in str(e)
        return
    try:
        out = llm.generate(
            [{"prompt_token_ids": [1, 2, 3]}],
            SamplingParams(max_tokens=3, temperature=0),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert len(out[0].outputs[0].token_ids) == 3


# ---- the rest of the engine on a quantized model --------------------------------------------------------


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_prefix_cache_and_preemption_keep_greedy_outputs(llama_dir, method):
    """A repeated prompt (served from the prefix cache) and requests preempted and recomputed
    (a KV pool of 15 blocks of 4 tokens) give the same greedy tokens as the first run."""
    prompts = [{"prompt_token_ids": p} for p in make_prompts(384, [5, 17, 30, 40], seed=6)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def tokens(outs):
        return [o.outputs[0].token_ids for o in outs]

    llm = LLM(model=llama_dir, quantization=method, dtype="bfloat16", device="cpu", block_size=4)
    try:
        first = tokens(llm.generate(prompts, params, use_tqdm=False))
        assert llm.engine.stats().prefix_cache_hits_total == 0
        again = tokens(llm.generate(prompts[::-1], params, use_tqdm=False))[::-1]
        assert llm.engine.stats().prefix_cache_hits_total > 0
    finally:
        llm.shutdown()
    assert again == first
    llm = LLM(
        model=llama_dir,
        quantization=method,
        dtype="bfloat16",
        device="cpu",
        block_size=4,
        num_kv_blocks=16,
        enable_prefix_caching=False,
    )
    try:
        preempted = tokens(llm.generate(prompts, params, use_tqdm=False))
        assert llm.engine.stats().num_preemptions_total > 0
    finally:
        llm.shutdown()
    assert preempted == first


def test_structured_outputs_on_int8(llama_dir):
    pytest.importorskip("xgrammar")
    from kvserve.engine.sampling_params import StructuredOutputs

    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 3},
        },
        "required": ["color"],
    }
    choices = ["yes", "no", "Zürich 東京"]
    llm = LLM(model=llama_dir, quantization="int8", dtype="bfloat16", device="cpu")
    try:
        params = [
            SamplingParams(
                temperature=1.0,
                seed=s,
                max_tokens=60,
                structured_outputs=StructuredOutputs(json=schema),
            )
            for s in range(4)
        ]
        params += [
            SamplingParams(
                temperature=1.0,
                seed=s,
                max_tokens=20,
                structured_outputs=StructuredOutputs(choice=choices),
            )
            for s in range(4)
        ]
        outs = llm.generate(["The quick brown fox"] * len(params), params, use_tqdm=False)
    finally:
        llm.shutdown()
    for out in outs[:4]:
        value = json.loads(out.outputs[0].text)
        assert value["color"] in ("red", "green") and set(value) <= {"color", "size"}
    assert all(out.outputs[0].text in choices for out in outs[4:])


# ---- the server ---------------------------------------------------------------------------------------


def test_server_serves_a_quantized_gguf_and_reports_its_weights(tmp_path):
    """`kvserve serve --model file.gguf` (a Q4_0 file: held as int4): completions stream, chat
    answers, and /metrics and the start-up log give the format and the weights' bytes."""
    import httpx

    from server_fixtures import ServerProcess, metric, scrape

    path = make_gguf(tmp_path, "llama", "Q4_0")
    server = ServerProcess(
        str(path), "--served-model-name", "q4", "--dtype", "bfloat16"
    ).wait_ready()
    try:
        body = {
            "model": "q4",
            "prompt": "Once upon",
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=180) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        # (deltas may be merged: a random model's tokens often end mid-character)
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: ") :])["usage"]["completion_tokens"] == 5
        chat = httpx.post(
            server.base_url + "/chat/completions",
            timeout=180,
            json={"model": "q4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 4
        samples = scrape(server.url)
        assert metric(samples, "kvserve:model_weight_bytes", quantization="int4") > 0
        assert metric(samples, "kvserve:model_weight_bytes", quantization="none") == 0
        assert "weights=int4" in server.log()
    finally:
        server.stop()
