"""kvserve.models.cpu_ops: the C++ CPU kernels against plain PyTorch references.

The kernels are built on first use (skipped where no compiler is available; CI has one).
"""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvserve.models import cpu_isa, cpu_ops

HAS_COMPILER = bool(shutil.which("c++") or shutil.which("g++"))


def test_kernels_build_where_a_compiler_exists():
    """Everything below skips when the kernels are unavailable: make sure that is never a broken build,
    and that a machine with a kernel set loads it."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler on this machine")
    assert cpu_ops.load(), "models/csrc failed to build (see the logged compiler error)"
    if cpu_isa.runnable():
        assert cpu_ops.isa() in cpu_isa.runnable()


CASCADE_LAKE = frozenset("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni".split())


@pytest.mark.parametrize(
    "flags, widest",
    [
        (CASCADE_LAKE | {"avx512_bf16"}, "avx512"),  # Cooper Lake, Sapphire Rapids, Zen 4
        (CASCADE_LAKE, "avx512vnni"),  # Cascade Lake, Ice Lake
        (CASCADE_LAKE - {"avx512_vnni"}, "avx2"),  # Skylake-SP
        (frozenset("avx2 fma f16c".split()), "avx2"),  # Zen 1-3, Intel client CPUs
        (frozenset("avx fma".split()), None),
    ],
)
def test_the_widest_set_follows_the_cpu_flags(flags, widest):
    runs = [isa for isa in cpu_isa.ISAS if not cpu_isa.missing_flags(isa, flags, "x86_64")]
    assert (runs[0] if runs else None) == widest


needs_kernels = pytest.mark.skipif(
    not cpu_ops.load(), reason="kvserve CPU kernels could not be built here"
)

# a test of a kernel set's op runs once per set this CPU can execute (skipped, naming the missing
# CPU features, where none can)
needs_bf16 = pytest.mark.usefixtures("kernel_set")


def reference_decode(
    q, k_cache, v_cache, block_table, seq_lens, scale, window, bias=None, softcap=None
):
    """Gather each request's keys, mask, softmax in float64. q [B, H, D] -> [B, H*D].
    bias [H, L]: key t of a request of length n gets bias[:, L - n + t]."""
    num_reqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    outs = []
    for b in range(num_reqs):
        n = int(seq_lens[b])
        first = max(0, n - window) if window else 0
        pos = torch.arange(first, n)
        slots = block_table[b, pos // block_size] * block_size + pos % block_size
        k = (
            k_cache.flatten(0, 1)[slots].double().repeat_interleave(num_heads // num_kv_heads, 1)
        )  # [L, H, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(num_heads // num_kv_heads, 1)
        scores = torch.einsum("hd,lhd->hl", q[b].double(), k) * scale
        if bias is not None:
            scores = scores + bias[:, bias.shape[1] - n + pos].double()
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v).flatten())
    return torch.stack(outs)


def reference_prefill(q, k_cache, v_cache, block_row, num_cached, scale, window, softcap=None):
    """Each new token attends, in float64, to the keys up to its own position (within the window).
    q [N, H, D] for positions num_cached .. num_cached + N - 1 -> [N, H*D]."""
    num_new, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    pos = torch.arange(num_cached + num_new)
    slots = block_row[pos // block_size] * block_size + pos % block_size
    k = (
        k_cache.flatten(0, 1)[slots].double().repeat_interleave(num_heads // num_kv_heads, 1)
    )  # [L, H, D]
    v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(num_heads // num_kv_heads, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = (num_cached + torch.arange(num_new))[:, None]
    hidden = pos[None, :] > query_pos
    if window:
        hidden |= pos[None, :] <= query_pos - window
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, v).flatten(1)


def random_paged_case(dtype, num_reqs, num_heads, num_kv_heads, head_dim, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, 200, (num_reqs,), generator=g)
    seq_lens[0] = 1  # a fresh request
    max_blocks = int(-(-seq_lens.max() // block_size))
    num_blocks = num_reqs * max_blocks + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=g)[: num_reqs * max_blocks] + 1  # never block 0
    block_table = perm.view(num_reqs, max_blocks)
    # q as the model makes it: a strided view of a [T, H + KvH, D] tensor
    qk = torch.randn(num_reqs, num_heads + num_kv_heads, head_dim, generator=g).to(dtype)
    return qk[:, :num_heads], k_cache, v_cache, block_table, seq_lens


@needs_bf16
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("block_size", [16, 5])  # 5: 16-token groups straddle blocks
@pytest.mark.parametrize("num_reqs", [7, 2])  # 2: one work item per (request, KV head)
def test_paged_decode_attention_matches_reference(heads, head_dim, window, block_size, num_reqs):
    q, k_cache, v_cache, table, seq_lens = random_paged_case(
        torch.bfloat16, num_reqs, *heads, head_dim, block_size
    )
    scale = head_dim**-0.5
    got = cpu_ops.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale, window)
    ref = reference_decode(q, k_cache, v_cache, table, seq_lens, scale, window)
    assert got.shape == (num_reqs, heads[0] * head_dim) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2)


@needs_bf16
# Gemma's 256: dims in more than one register block
@pytest.mark.parametrize("head_dim", [160, 256])
@pytest.mark.parametrize("window", [None, 37])
def test_paged_attention_of_wide_heads_matches_reference(head_dim, window):
    q, k_cache, v_cache, table, seq_lens = random_paged_case(torch.bfloat16, 7, 9, 3, head_dim, 5)
    scale = head_dim**-0.5
    got = cpu_ops.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale, window)
    ref = reference_decode(q, k_cache, v_cache, table, seq_lens, scale, window)
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2)
    check_paged_prefill((9, 3), head_dim, 70, 33, window, None)


@needs_bf16
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize(
    "extra", [0, 13]
)  # a table exactly as long as the longest request, or longer
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_paged_decode_attention_adds_a_bias_by_distance(heads, extra, scale):
    """T5's relative bias: a float32 [H, L] table indexed by distance from the query, added to the
    scaled scores (cross-attention is the same kernel without one)."""
    q, k_cache, v_cache, table, seq_lens = random_paged_case(
        torch.bfloat16, 5, *heads, 64, 16, seed=3
    )
    length = int(seq_lens.max()) + extra
    bias = torch.randn(heads[0], length, generator=torch.Generator().manual_seed(1)) * 3
    got = cpu_ops.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale, None, bias)
    ref = reference_decode(q, k_cache, v_cache, table, seq_lens, scale, None, bias)
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="shorter than the longest"):
        cpu_ops.paged_decode_attention(
            q, k_cache, v_cache, table, seq_lens, scale, None, bias[:, :10]
        )
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.paged_decode_attention(
            q, k_cache, v_cache, table, seq_lens, scale, None, bias.bfloat16()
        )


@needs_bf16
def test_paged_decode_attention_rejects_what_it_does_not_handle():
    q, k_cache, v_cache, table, seq_lens = random_paged_case(torch.bfloat16, 2, 4, 2, 32)
    with pytest.raises(RuntimeError, match="head shapes"):
        cpu_ops.paged_decode_attention(q[:, :3], k_cache, v_cache, table, seq_lens, 1.0, None)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_ops.paged_decode_attention(
            q.float(), k_cache.float(), v_cache.float(), table, seq_lens, 1.0, None
        )
    q16, k16, v16, table16, lens16 = random_paged_case(torch.bfloat16, 2, 4, 2, 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops.paged_decode_attention(q16, k16, v16, table16, lens16, 1.0, None)
    assert not cpu_ops.attention_kernels_apply(q.float(), 32)  # fp32 goes to gather + SDPA
    assert not cpu_ops.attention_kernels_apply(q16, 16)


@needs_bf16
@pytest.mark.parametrize("rows", [8, 31, 32, 64, 65, 257])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (64, 50), (96, 130)])
def test_linear_bf16_strided_rows_on_the_tile_path(rows, in_features, out_features):
    """From a few rows on, CPUs with AMX-BF16 multiply in tiles of 32 x 32 (a zero-padded copy for
    the last rows); x as the model passes it: rows of a wider tensor."""
    torch.manual_seed(rows)
    wide = torch.randn(rows, in_features + 32).bfloat16()
    x = wide[:, 16 : 16 + in_features]
    w = torch.randn(out_features, in_features).bfloat16()
    b = torch.randn(out_features)
    got = cpu_ops.linear_bf16(x, cpu_ops.pack_linear_weight(w), b, out_features)
    torch.testing.assert_close(
        got.double(), F.linear(x.double(), w.double(), b.double()), atol=0.05, rtol=1 / 128
    )


@needs_bf16
def test_linear_bf16_rows_are_batch_invariant_with_amx_off():
    """With the AMX tiles off (`set_amx(False)`, `KVSERVE_CPU_AMX=0`) a row's result is the same bits
    whether it is multiplied alone or among 64 rows; with them on (CPUs with AMX) it is the same up
    to the fp32 sums' order."""
    torch.manual_seed(0)
    x = torch.randn(64, 576).bfloat16()
    w = cpu_ops.pack_linear_weight(torch.randn(960, 576).bfloat16())
    alone = torch.cat([cpu_ops.linear_bf16(x[i : i + 1], w, None, 960) for i in range(0, 64, 9)])
    previous = cpu_ops.set_amx(False)
    try:
        assert torch.equal(cpu_ops.linear_bf16(x, w, None, 960)[::9], alone)
    finally:
        cpu_ops.set_amx(previous)
    torch.testing.assert_close(
        cpu_ops.linear_bf16(x, w, None, 960)[::9], alone, atol=0.05, rtol=1 / 128
    )


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 33, 100, 300])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (64, 50), (130, 17), (1536, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_matches_float_reference(rows, in_features, out_features, bias):
    torch.manual_seed(rows + in_features)
    x = torch.randn(rows, in_features).bfloat16()
    w = torch.randn(out_features, in_features).bfloat16()
    b = torch.randn(out_features) if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = cpu_ops.linear_bf16(x, cpu_ops.pack_linear_weight(w), b, out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    # fp32 accumulation, one rounding to bf16 at the end
    torch.testing.assert_close(got.double(), ref, atol=0.05, rtol=1 / 128)


@needs_bf16
def test_linear_bf16_strided_input_and_no_rows():
    w = torch.randn(40, 64).bfloat16()
    packed = cpu_ops.pack_linear_weight(w)
    x = torch.randn(3, 128).bfloat16()[:, :64]  # row stride 128
    torch.testing.assert_close(
        cpu_ops.linear_bf16(x, packed, None, 40).float(),
        F.linear(x.float(), w.float()),
        atol=0.05,
        rtol=1 / 128,
    )
    assert cpu_ops.linear_bf16(x[:0], packed, None, 40).shape == (0, 40)


@pytest.mark.parametrize("n", [5, 64, 70, 128])
def test_pack_linear_weight_into_a_dirty_buffer_matches_a_fresh_pack(n):
    w = torch.randn(n, 8).bfloat16()
    padded = torch.cat([w, w.new_zeros(-n % 64, 8)])  # [N64, K]: the layout, the slow way
    expected = padded.view(-1, 64, 4, 2).permute(0, 2, 1, 3).contiguous()
    out = torch.full(cpu_ops.packed_linear_shape(w.shape), 7.0, dtype=torch.bfloat16)
    assert cpu_ops.pack_linear_weight(w, out=out) is out
    assert torch.equal(out, expected) and torch.equal(cpu_ops.pack_linear_weight(w), expected)


@needs_kernels
def test_pack_linear_weight_layout():
    w = torch.arange(70 * 4, dtype=torch.float32).view(70, 4).bfloat16()
    packed = cpu_ops.pack_linear_weight(w)
    assert packed.shape == (2, 2, 64, 2)  # 70 columns -> two 64-column blocks, K=4 -> two pairs
    assert packed[1, 1, 5].tolist() == w[64 + 5, 2:4].tolist()
    assert packed[1, 0, 6:].abs().sum() == 0  # padding columns are zero
    with pytest.raises(ValueError, match="even"):
        cpu_ops.pack_linear_weight(torch.zeros(4, 3).bfloat16())


@pytest.mark.usefixtures("kernel_set_or_none")
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [9, 300])  # 300: past FUSED_MAX_ROWS (bf16 AVX-512 path only)
def test_fused_rms_norm_matches_the_pytorch_path(dtype, rows):
    torch.manual_seed(rows)
    from kvserve.models.cpu_model import CpuFusedOps
    from kvserve.models.layers import RMSNorm

    norm = RMSNorm(576, eps=1e-5).to(dtype)
    norm.ops = CpuFusedOps()
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(rows, 1000) * 3).to(dtype)[:, :576]  # strided rows, as a residual view can be
    got = cpu_ops.rms_norm(x, norm.weight, norm.eps)
    ref = (
        F.rms_norm(x, (576,), norm.weight, norm.eps)
        if dtype == torch.float32
        else (norm.weight * F.rms_norm(x, (576,), None, norm.eps))
    )
    # bf16: the normalized value is rounded before the weight multiplies it, so a sum of squares
    # added in another order can move it one bf16 step, which the product's rounding can make
    # a little more than 1/128 relative
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=1 / 64)
    torch.testing.assert_close(got, ref, **tol)
    if dtype == torch.bfloat16:  # the module takes the fused op for few bf16 rows
        torch.testing.assert_close(norm(x), ref, **tol)


@pytest.mark.usefixtures("kernel_set_or_none")
@needs_kernels
@pytest.mark.parametrize("rows", [1, 9, 300])
def test_add_and_norm_fuses_the_residual_add_exactly(rows):
    torch.manual_seed(rows)
    from kvserve.models.cpu_model import CpuFusedOps
    from kvserve.models.layers import RMSNorm

    norm = RMSNorm(576, eps=1e-5).to(torch.bfloat16)
    norm.ops = CpuFusedOps()
    with torch.no_grad():
        norm.weight.normal_()
    residual = (torch.randn(rows, 576) * 3).bfloat16()
    x = (torch.randn(rows, 1000) * 3).bfloat16()[:, :576]  # strided rows
    expected_sum = residual + x
    normed, new_residual = norm.add_and_norm(x, residual.clone())
    assert torch.equal(new_residual, expected_sum)  # one bf16 rounding of the sum, as PyTorch's add
    # the module's own norm of the sum: the fused op where it applies (a kernel set, or few rows),
    # else PyTorch's ops
    fused = cpu_ops.use_fused_bf16_rows(x)
    own = (
        cpu_ops.rms_norm(expected_sum, norm.weight, norm.eps)
        if fused
        else (norm.weight * F.rms_norm(expected_sum, (576,), None, norm.eps))
    )
    assert torch.equal(normed, own)
    torch.testing.assert_close(
        normed, norm.weight * F.rms_norm(expected_sum, (576,), None, norm.eps), atol=0, rtol=1 / 64
    )  # one bf16 step (test_fused_rms_norm_matches_the_pytorch_path)
    # fp32 keeps PyTorch's ops (their sum order is HF's)
    norm32 = RMSNorm(576, eps=1e-5)
    norm32.ops = norm.ops
    with torch.no_grad():
        norm32.weight.copy_(norm.weight.float())
    r32, x32 = residual.float(), x.float()
    normed32, sum32 = norm32.add_and_norm(x32, r32.clone())
    assert torch.equal(sum32, r32 + x32)
    assert torch.equal(normed32, F.rms_norm(r32 + x32, (576,), norm32.weight, 1e-5))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_index_copy(dtype):
    kv_heads, head_dim, tokens = 3, 64, 37
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim).to(dtype)
    k = qkv[:, 9 * head_dim : 12 * head_dim].view(
        tokens, kv_heads, head_dim
    )  # strided rows, as in a layer
    v = qkv[:, 12 * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(10 * 16)[:tokens]
    cache = torch.zeros(2, 10, 16, kv_heads, head_dim, dtype=dtype)
    ref = cache.clone()
    ref[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    ref[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
    cpu_ops.write_kv_cache(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache, ref)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.write_kv_cache(k, v, cache[0], cache[1], slots + 160)


@pytest.mark.usefixtures("kernel_set_or_none")
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotary_matches_apply_rotary(dtype):
    from kvserve.models.layers import RotaryEmbedding, apply_rotary

    heads, kv_heads, head_dim = 9, 3, 64
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0}).to(
        dtype
    )
    positions = torch.tensor([0, 1, 7, 300, 4095])
    cos_sin = rope(positions)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim).to(dtype)
    ref = apply_rotary(
        qkv[:, : (heads + kv_heads) * head_dim].view(5, heads + kv_heads, head_dim), cos_sin
    )
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    cpu_ops.rotary_(qkv, cos_sin, heads + kv_heads, head_dim)
    torch.testing.assert_close(
        qkv[:, : (heads + kv_heads) * head_dim], ref.flatten(1), atol=0, rtol=0
    )
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # values untouched


@needs_bf16
def test_bf16_engine_with_kernels_agrees_with_the_pytorch_path(tmp_path, monkeypatch):
    """Whole-engine bf16 smoke test of the AVX-512 paths (head_dim 64, tied head, GQA).

    bf16 roundings differ between the two paths, so tokens are compared up to the first
    step where the PyTorch path's top two log-probs are within 0.1 (either is then a fair
    greedy pick), and log-probs to 0.1.
    """
    from checkpoints import make_checkpoint
    from kvserve.engine import LLM, SamplingParams

    path = make_checkpoint(
        tmp_path / "hd64",
        "llama",
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )  # peaked: few near-ties for bf16 to flip
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 9, 40, 70)]

    def run():
        llm = LLM(path, dtype="bfloat16", device="cpu", block_size=16)
        return llm.generate(prompts, params, use_tqdm=False)

    fast = run()
    with monkeypatch.context() as m:
        m.setattr(cpu_ops, "load", lambda: False)
        m.setattr(cpu_ops, "has_fast_bf16", lambda: False)
        slow = run()
    compared = 0
    for a, b in zip(fast, slow):
        ta, tb = a.outputs[0], b.outputs[0]
        for step, (x, y) in enumerate(zip(ta.token_ids, tb.token_ids)):
            assert ta.logprobs[step][x].logprob == pytest.approx(
                tb.logprobs[step][x].logprob, abs=0.1
            )
            top2 = sorted((lp.logprob for lp in tb.logprobs[step].values()), reverse=True)[:2]
            if x != y or len(top2) < 2 or top2[0] - top2[1] < 0.1:
                assert x == y or top2[0] - top2[1] < 0.1, f"step {step}: {x} vs {y}"
                break
            compared += 1
    assert compared >= 10  # the comparison is not vacuous


@needs_bf16
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152, 50257])
def test_greedy_argmax_matches_torch_including_ties(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g).bfloat16()
    logits[1] = 0.0  # all tied: the first index
    logits[2, vocab // 2 :] = 100.0  # tie between the halves: the first of them
    logits[3, -1] = 1000.0  # the maximum in the tail
    logits[4] = float("-inf")
    logits[4, vocab // 3] = -1e30
    torch.testing.assert_close(cpu_ops.greedy_argmax(logits), logits.argmax(dim=-1))


@needs_bf16
@pytest.mark.parametrize("rows, inter", [(1, 1536), (7, 100), (64, 1536), (300, 1536)])
def test_fused_silu_and_mul_matches_pytorch(rows, inter):
    from kvserve.models.fused_ops import TORCH_OPS

    x = (torch.randn(rows, 2 * inter) * 4).bfloat16()
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # saturated and zero gates
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = cpu_ops.silu_and_mul(x)
    # ~1-ulp exp differences may flip a bf16 rounding: at most one bf16 step apart
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-6, rtol=1 / 128)
    torch.testing.assert_close(TORCH_OPS.silu_and_mul(x), got)


@needs_bf16
def test_fused_rotary_avx512_path_is_bitwise_pytorch():
    from kvserve.models.layers import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(128, 2048, {"rope_type": "default", "rope_theta": 500000.0}).to(
        torch.bfloat16
    )
    cos_sin = rope(torch.tensor([3, 1000, 2047]))
    x = torch.randn(3, 6 * 128).bfloat16()
    ref = apply_rotary(x.view(3, 6, 128), cos_sin).flatten(1)
    cpu_ops.rotary_(x, cos_sin, 6, 128)
    assert torch.equal(x, ref)


@needs_bf16
@pytest.mark.parametrize(
    "heads", [(9, 3), (4, 4), (8, 1), (32, 1)]
)  # (32, 1): 512 query rows per block
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize(
    "num_cached, num_new, window",
    [
        (0, 1, None),
        (0, 37, None),
        (0, 130, None),
        (45, 20, None),
        (100, 1, None),
        (0, 130, 40),
        (70, 33, 24),
    ],
)
def test_paged_prefill_attention_matches_reference(heads, head_dim, num_cached, num_new, window):
    check_paged_prefill(heads, head_dim, num_cached, num_new, window, None)


@needs_bf16
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("window", [None, 37])
def test_paged_attention_soft_caps_scores(heads, window):
    """Gemma 2's logit soft-capping (a small cap, so that most scores are capped), decode and
    prefill (a cached prefix, a window)."""
    q, k_cache, v_cache, table, seq_lens = random_paged_case(torch.bfloat16, 7, *heads, 64, 5)
    q = q * 4  # large scores
    got = cpu_ops.paged_decode_attention(
        q, k_cache, v_cache, table, seq_lens, 0.125, window, softcap=1.5
    )
    ref = reference_decode(q, k_cache, v_cache, table, seq_lens, 0.125, window, softcap=1.5)
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2)
    assert (
        got.double() - reference_decode(q, k_cache, v_cache, table, seq_lens, 0.125, window)
    ).abs().max() > 0.1
    check_paged_prefill(heads, 64, 45, 40, window, 1.5)


def check_paged_prefill(heads, head_dim, num_cached, num_new, window, softcap):
    num_heads, num_kv_heads = heads
    seq_len = num_cached + num_new
    q1, k_cache, v_cache, _, _ = random_paged_case(
        torch.bfloat16, 1, num_heads, num_kv_heads, head_dim
    )
    g = torch.Generator().manual_seed(seq_len)
    num_blocks = -(-seq_len // 16)
    k_cache = torch.randn(num_blocks + 5, 16, num_kv_heads, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks + 5, 16, num_kv_heads, head_dim, generator=g).bfloat16()
    row = torch.randperm(num_blocks + 4, generator=g)[:num_blocks] + 1
    qkv = torch.randn(num_new, num_heads + num_kv_heads, head_dim, generator=g).bfloat16()
    q = qkv[:, :num_heads]  # strided, as the model passes it
    scale = head_dim**-0.5
    got = cpu_ops.paged_prefill_attention(
        q, k_cache, v_cache, row, seq_len, scale, window, softcap=softcap
    )
    ref = reference_prefill(q, k_cache, v_cache, row, num_cached, scale, window, softcap)
    assert got.shape == (num_new, num_heads * head_dim)
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2)


@needs_bf16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows,vocab,k", [(3, 100, 5), (64, 5003, 20), (4, 17, 17), (2, 33, 0), (1, 16, 1)]
)
def test_logprobs_topk_matches_torch(dtype, rows, vocab, k):
    """The sampler's log-softmax at the sampled tokens and its top k in one op: torch's values (fp32
    sums in another order), the same ids, ties to the lower id."""
    torch.manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    logits[0, vocab // 2] = logits[0, vocab // 3] = logits[0].max() + 1  # a tie at the top
    tokens = torch.randint(0, vocab, (rows,))
    sampled, top, ids = cpu_ops.logprobs_topk(logits, tokens, k)
    raw = logits.float()
    norm = torch.logsumexp(raw, -1, keepdim=True)
    torch.testing.assert_close(
        sampled, (raw.gather(1, tokens[:, None]) - norm)[:, 0], atol=1e-5, rtol=1e-6
    )
    values, _ = raw.topk(k, -1)
    torch.testing.assert_close(top, values - norm, atol=1e-5, rtol=1e-6)
    assert torch.equal(raw.gather(1, ids), values) and ids.dtype == torch.int64
    if k >= 2:
        assert ids[0, :2].tolist() == [vocab // 3, vocab // 2]


# ---- the host library: no torch headers, torch's threads, errors as exceptions -------------------


def test_host_library_sources_have_no_torch_or_python_headers():
    """It compiles in seconds because nothing in models/csrc includes torch's (or Python's) headers."""
    for path in [*cpu_ops.cpu_build.CSRC.rglob("*.cpp"), *cpu_ops.cpu_build.CSRC.rglob("*.h")]:
        includes = [line for line in path.read_text().splitlines() if line.startswith("#include")]
        assert not [
            i
            for i in includes
            if any(w in i for w in ("torch", "ATen", "c10", "Python.h", "pybind"))
        ], path


def test_the_image_check_names_the_host_library_folder_as_the_build_does():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "check_image", cpu_ops.cpu_build.CSRC.parents[1] / "docker" / "check_image.py"
    )
    check_image = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_image)
    assert check_image.kernels_digest() == cpu_ops.host_library().parent.name
    assert check_image.HOST_FLAGS == " ".join(cpu_ops.cpu_build.HOST_FLAGS)


def test_a_failed_build_is_an_exception_per_library(tmp_path, monkeypatch):
    from kvserve.models import cpu_build

    monkeypatch.setenv("KVSERVE_CPU_OPS_DIR", str(tmp_path))
    (result,) = cpu_build.build(
        [cpu_build.host_target()], compiler=str(tmp_path / "no-such-compiler")
    )
    assert isinstance(result, OSError)
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    target = cpu_build.Target(
        "broken", tmp_path / "broken" / "broken.so", [bad], ["-std=c++17"], []
    )
    (result,) = cpu_build.build([target])
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler on this machine")
    assert isinstance(result, RuntimeError) and "building the broken CPU library failed" in str(
        result
    )
    assert list((tmp_path / "broken").iterdir()) == []  # nothing half-built left behind


@needs_kernels
def test_a_kernel_set_that_cannot_load_is_an_error_not_a_crash(tmp_path):
    with pytest.raises(RuntimeError, match="cannot load the CPU kernel set"):
        cpu_ops._load_set(tmp_path / "missing.so", "avx2")
    if cpu_ops.isa() != "none":
        with pytest.raises(RuntimeError, match="has no kernel set named neon"):
            cpu_ops._load_set(cpu_ops.set_library(cpu_ops.isa()), "neon")
    assert cpu_ops._lib.kv_kernel_set().decode() == (
        cpu_ops.isa() if cpu_ops.isa() != "none" else ""
    )


@needs_kernels
def test_without_a_set_the_scalar_fallbacks_run_and_the_rest_says_why_not():
    torch.manual_seed(0)
    previous = cpu_ops.use_isa("none")
    try:
        assert cpu_ops.isa() == "none" and not cpu_ops.has_fast_bf16() and not cpu_ops.has_amx()
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(5, 96).to(dtype), torch.randn(96).to(dtype)
            ref = (
                F.rms_norm(x, (96,), w, 1e-6)
                if dtype == torch.float32
                else w * F.rms_norm(x, (96,), None, 1e-6)
            )
            torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), ref, atol=1e-5, rtol=1 / 64)
        residual, x = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16()
        expected = residual + x
        ones = torch.ones(64).bfloat16()
        normed = cpu_ops.add_rms_norm_(residual, x, ones, 1e-6)
        assert torch.equal(residual, expected) and torch.equal(
            normed, cpu_ops.rms_norm(expected, ones, 1e-6)
        )
        with pytest.raises(RuntimeError, match="no CPU kernel set is loaded"):
            cpu_ops.silu_and_mul(torch.zeros(2, 64).bfloat16())
        with pytest.raises(RuntimeError, match="no CPU kernel set is loaded"):
            cpu_ops.linear_bf16(
                ones[None], cpu_ops.pack_linear_weight(torch.zeros(8, 64).bfloat16()), None, 8
            )
        assert cpu_ops.logprobs_topk(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), 1) is None
        assert torch.equal(
            cpu_ops.greedy_argmax(torch.eye(3).bfloat16()), torch.arange(3)
        )  # torch.argmax
    finally:
        cpu_ops.use_isa(previous)


@needs_kernels
def test_the_kernels_use_torchs_thread_pool_or_one_thread_without_it():
    """torch_parallel_for / torch_get_num_threads are torch's C shim (torch >= 2.10); a torch
    without them (null pointers here) leaves a serial host: the same results on one thread."""
    parallel_for, num_threads = cpu_ops.torch_thread_pool()
    assert parallel_for and num_threads  # this torch has them
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert cpu_ops._lib.kv_num_threads() == 1  # torch's setting, read through the shim
    finally:
        torch.set_num_threads(before)
    assert cpu_ops._lib.kv_num_threads() == before
    x, w = (torch.randn(300, 576) * 3).bfloat16(), torch.randn(576).bfloat16()
    threaded = cpu_ops.rms_norm(x, w, 1e-5)
    slots = torch.randperm(64)[:40]
    k = torch.randn(40, 2, 32)
    try:
        assert not cpu_ops.init_threads(None, None)
        assert cpu_ops._lib.kv_num_threads() == 1
        assert torch.equal(cpu_ops.rms_norm(x, w, 1e-5), threaded)
        cache = torch.zeros(2, 4, 16, 2, 32)
        cpu_ops.write_kv_cache(k, k, cache[0], cache[1], slots)
        assert torch.equal(cache[0].view(-1, 2, 32)[slots], k)
    finally:
        assert cpu_ops.init_threads(parallel_for, num_threads)


@needs_kernels
def test_bad_arguments_raise_clear_errors():
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="rms_norm: x"):
        cpu_ops.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="supports float32 and bfloat16"):
        cpu_ops.rms_norm(x.half(), torch.ones(64).half(), 1e-6)
    with pytest.raises(RuntimeError, match="rotary_: cos_sin"):
        cpu_ops.rotary_(x, torch.zeros(4, 2, 16).bfloat16(), 2, 16)
    with pytest.raises(RuntimeError, match="add_rms_norm_ supports bfloat16"):
        cpu_ops.add_rms_norm_(x.clone(), x, torch.ones(64), 1e-6)
    cache = torch.zeros(2, 4, 16, 2, 32)
    k = torch.randn(3, 2, 32)
    with pytest.raises(RuntimeError, match="slots must be int64"):
        cpu_ops.write_kv_cache(k, k, cache[0], cache[1], torch.arange(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.write_kv_cache(k, k, cache[0], cache[1], torch.tensor([0, -1, 2]))
    with pytest.raises(RuntimeError, match="caches must be contiguous"):
        cpu_ops.write_kv_cache(k, k, cache[0][:, :8], cache[1][:, :8], torch.arange(3))
    with pytest.raises(RuntimeError, match="bitmask must be"):
        cpu_ops.apply_token_bitmask_(
            torch.zeros(2, 40), torch.zeros(2, 2, dtype=torch.int64), torch.tensor([0])
        )


@needs_bf16
def test_linear_and_stack_arguments_are_checked():
    packed = cpu_ops.pack_linear_weight(torch.randn(70, 64).bfloat16())
    with pytest.raises(RuntimeError, match="features"):
        cpu_ops.linear_bf16(torch.zeros(2, 32).bfloat16(), packed, None, 70)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        cpu_ops.linear_bf16(torch.zeros(2, 64).bfloat16(), packed, None, 200)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        cpu_ops.linear_bf16(torch.zeros(2, 64).bfloat16(), packed, torch.zeros(70).bfloat16(), 70)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_ops.linear_bf16(torch.zeros(2, 64), packed, None, 70)
    with pytest.raises(RuntimeError, match="argmax_bf16"):
        cpu_ops.argmax_bf16(torch.zeros(2, 8))
    stack = cpu_ops.DecoderStack(1e-6)
    with pytest.raises(RuntimeError, match="add four linears before each layer"):
        stack.add_layer(
            *[torch.ones(64).bfloat16()] * 2,
            None,
            None,
            *torch.zeros(2, 4, 16, 2, 32).bfloat16(),
            2,
            2,
            32,
            0,
            1.0,
            1e-6,
        )
    with pytest.raises(RuntimeError, match="bits must be 16, 8 or 4"):
        stack.add_linear(
            torch.zeros(1, 2, 256, dtype=torch.uint8), torch.zeros(1, 1, 64).half(), None, 64, 2, 8
        )
    with pytest.raises(RuntimeError, match="has no layers"):
        stack.forward(
            torch.zeros(1, 0).bfloat16(),
            torch.zeros(0).bfloat16(),
            torch.zeros(1, 2, 0).bfloat16(),
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            [1],
            [1],
        )


@needs_bf16
def test_stack_rejects_query_lengths_that_do_not_add_up():
    hidden, heads, kv_heads, d, inter = 64, 2, 2, 32, 96
    stack = cpu_ops.DecoderStack(1e-6)
    for n, k in (
        (heads * d + 2 * kv_heads * d, hidden),
        (hidden, heads * d),
        (2 * inter, hidden),
        (hidden, inter),
    ):
        stack.add_linear(
            cpu_ops.pack_linear_weight(torch.randn(n, k).bfloat16() * 0.1), None, None, n, 16, 0
        )
    cache = torch.zeros(2, 4, 16, kv_heads, d).bfloat16()
    stack.add_layer(
        torch.ones(hidden).bfloat16(),
        torch.ones(hidden).bfloat16(),
        None,
        None,
        cache[0],
        cache[1],
        heads,
        kv_heads,
        d,
        0,
        d**-0.5,
        1e-6,
    )
    args = (
        torch.ones(hidden).bfloat16(),
        torch.ones(3, 2, d).bfloat16(),
        torch.tensor([1, 2, 3]),
        torch.tensor([[1, 2]]),
        torch.tensor([3]),
    )
    with pytest.raises(RuntimeError, match="add up to 2, not 3 rows"):
        stack.forward(torch.randn(3, hidden).bfloat16(), *args, [2], [3])
    with pytest.raises(RuntimeError, match="out of range"):
        stack.forward(
            torch.randn(3, hidden).bfloat16(),
            *args[:2],
            torch.tensor([1, 2, 999]),
            *args[3:],
            [3],
            [3],
        )
    out = stack.forward(
        torch.randn(3, hidden).bfloat16(), *args, [3], [3]
    )  # one prefill of three tokens
    assert out.shape == (3, hidden) and torch.isfinite(out.float()).all()


@needs_bf16
def test_lora_rows_that_do_not_fit_are_refused():
    """cpu_ops.lora_apply_ (models/lora_cpu.py's packed slots): a slot or a row out of range, segments
    that do not cover the rows, and packed slots of the wrong shape fail with a message."""
    # two slots of rank 8 on one 40-column shard: a [S, 1, k, 16], b [S, rank, 40 padded to 48]
    a, b = torch.zeros(2, 1, 64, 16).bfloat16(), torch.zeros(2, 8, 48).bfloat16()
    x, y, shard_n = torch.zeros(3, 64).bfloat16(), torch.zeros(3, 40).bfloat16(), torch.tensor([40])

    def rows(order, starts, lens, slots):
        i32 = functools.partial(torch.tensor, dtype=torch.int32)
        return torch.tensor(order, dtype=torch.int64), i32(starts), i32(lens), i32(slots)

    cpu_ops.lora_apply_(y, x, a, b, shard_n, 8, rows([2, 0], [0, 1], [1, 1], [1, 0]))  # fits
    with pytest.raises(RuntimeError, match="segment 0"):
        cpu_ops.lora_apply_(y, x, a, b, shard_n, 8, rows([2], [0], [1], [2]))
    with pytest.raises(RuntimeError, match="row 3 is out of range"):
        cpu_ops.lora_apply_(y, x, a, b, shard_n, 8, rows([3], [0], [1], [0]))
    with pytest.raises(RuntimeError, match="do not cover"):
        cpu_ops.lora_apply_(y, x, a, b, shard_n, 8, rows([0, 1], [0], [1], [0]))
    with pytest.raises(RuntimeError, match="packed slots"):
        cpu_ops.lora_apply_(y, x, a, b, shard_n, 16, rows([0], [0], [1], [0]))


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm_heads_normalizes_each_head_in_place(rows):
    """Qwen3's q/k norms, in place in qkv: each head is the set's rms_norm of that head's row,
    the other columns untouched."""
    heads, kv_heads, d = 4, 2, 64
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * d) * 3).bfloat16()
    w = torch.randn(d).bfloat16()
    before = qkv.clone()
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(rows, kv_heads, d)
    cpu_ops.rms_norm_heads_(k, w, 1e-6)
    expected = cpu_ops.rms_norm(
        before[:, heads * d : (heads + kv_heads) * d].reshape(-1, d), w, 1e-6
    )
    assert torch.equal(k.reshape(-1, d), expected)
    assert torch.equal(qkv[:, : heads * d], before[:, : heads * d])
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], before[:, (heads + kv_heads) * d :])
    torch.testing.assert_close(
        k,
        w
        * F.rms_norm(
            before[:, heads * d : (heads + kv_heads) * d].view(rows, kv_heads, d), (d,), None, 1e-6
        ),
        atol=0,
        rtol=1 / 64,
    )


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_token_bitmask_in_every_logits_dtype(dtype):
    logits = torch.randn(3, 100).to(dtype)
    bitmask = torch.full((3, 4), -1, dtype=torch.int32)
    bitmask[1, 0] = 0b101  # tokens 0 and 2 of the first word allowed
    bitmask[1, 1:3] = 0  # 32..95 banned
    before = logits.clone()
    assert cpu_ops.apply_token_bitmask_(logits, bitmask, torch.tensor([1]))
    allowed = torch.zeros(100, dtype=torch.bool)
    allowed[[0, 2]] = True
    allowed[96:] = True
    assert torch.equal(logits[1][allowed], before[1][allowed])
    assert (logits[1][~allowed] == float("-inf")).all()
    assert torch.equal(logits[[0, 2]], before[[0, 2]])


def test_concurrent_builds_into_one_cache_compile_once(tmp_path, monkeypatch):
    """The server's processes load the kernels at the same time: they take turns (a file lock), and
    the ones that wait find the library built."""
    import threading

    from kvserve.models import cpu_build

    if not HAS_COMPILER:
        pytest.skip("no C++ compiler on this machine")
    monkeypatch.setenv("KVSERVE_CPU_OPS_DIR", str(tmp_path))
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int tiny() { return 1; }\n')
    log = tmp_path / "compiles.log"
    compiler = tmp_path / "cxx"
    compiler.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\nsleep 0.5\nexec {shutil.which("c++") or "g++"} "$@"\n'
    )
    compiler.chmod(0o755)
    target = cpu_build.Target("tiny", tmp_path / "tiny" / "tiny.so", [source], ["-fPIC"], [])
    results = []
    threads = [
        threading.Thread(target=lambda: results.extend(cpu_build.build([target], str(compiler))))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target.library] * 3
    assert sum(" -c " in line for line in log.read_text().splitlines()) == 1


@pytest.mark.parametrize("refused", [False, True], ids=["precompiled", "read-as-is"])
def test_a_sets_header_is_precompiled_once_or_read_as_is(tmp_path, monkeypatch, refused):
    """Each unit starts from the set's header compiled once (`-include` finds the .gch in the build
    folder); a compiler that cannot precompile it builds the same library from the header itself."""
    import ctypes

    from kvserve.models import cpu_build

    if not HAS_COMPILER:
        pytest.skip("no C++ compiler on this machine")
    monkeypatch.setenv("KVSERVE_CPU_OPS_DIR", str(tmp_path))
    header = tmp_path / "tiny.h"
    header.write_text("#pragma once\ninline int one() { return 1; }\n")
    sources = [tmp_path / f"u{i}.cpp" for i in range(2)]
    for i, source in enumerate(sources):
        source.write_text(f'#include "tiny.h"\nextern "C" int u{i}() {{ return one() + {i}; }}\n')
    log, compiler = tmp_path / "compiles.log", tmp_path / "cxx"
    refuse = 'case "$*" in *c++-header*) exit 1;; esac\n' if refused else ""
    compiler.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\n{refuse}exec {shutil.which("c++") or "g++"} "$@"\n'
    )
    compiler.chmod(0o755)
    target = cpu_build.Target(
        "tiny", tmp_path / "tiny" / "tiny.so", sources, ["-fPIC", "-std=c++17"], [], header
    )
    (result,) = cpu_build.build([target], str(compiler))
    assert result == target.library
    lines = log.read_text().splitlines()
    assert sum("c++-header" in line for line in lines) == 1
    units = [line for line in lines if " -c " in line]
    assert len(units) == 2 and all(("-include tiny.h" in line) != refused for line in units)
    library = ctypes.CDLL(str(result))
    assert (library.u0(), library.u1()) == (1, 2)
