"""models/kernels/triton_attention.py under Triton's CPU interpreter, against a plain torch reference.

The cache is filled with NaN everywhere no live token is (the null block, unowned blocks, the
tail of a request's last block), so a kernel that reads past a mask shows up as NaN. Tile and
partition sizes are shrunk so that short sequences cross several tiles, splits and query blocks.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (the kernels run on the CPU)

import subprocess
import sys

import pytest
import torch

pytest.importorskip("numpy")
pytest.importorskip("triton")

from kvserve.models.kernels import triton_attention as ta  # noqa: E402


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(ta, "DECODE_BLOCK_N", 16)
    monkeypatch.setattr(ta, "DECODE_PARTITION_SIZE", 32)
    monkeypatch.setattr(ta, "DECODE_MAX_SPLITS", 8)
    monkeypatch.setattr(ta, "PREFILL_BLOCK_M", 16)
    monkeypatch.setattr(ta, "PREFILL_BLOCK_N", 16)
    monkeypatch.setattr(ta, "REDUCE_SPLIT_TILE", 2)


def make_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0):
    """k_cache, v_cache [num_blocks, block_size, KvH, D] (NaN but for live tokens), block_table int32."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 2  # null block + owned + two spare
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq, default=0) + 1, dtype=torch.int32)
    kv = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    for r, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        own, ids = ids[:n], ids[n:]
        block_table[r, :n] = torch.tensor(own, dtype=torch.int32)
        pos = torch.arange(seq_len)
        blk = block_table[r, pos // block_size].long()
        kv[:, blk, pos % block_size] = torch.randn(
            2, seq_len, num_kv_heads, head_dim, generator=gen
        )
    kv = kv.to(dtype)
    return kv[0], kv[1], block_table


def reference(
    q, k_cache, v_cache, block_table, seq_lens, query_lens, scale, window, bias=None, softcap=None
):
    """[T, H, D] fp32: each request's keys gathered by block table, explicit causal/window mask;
    `bias` [H, L]: the score of key t for a query at position p gets bias[:, L - 1 - (p - t)]."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out, row = torch.zeros(q.shape, dtype=torch.float32), 0
    for r, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        pos = torch.arange(seq_len)
        blk = block_table[r, pos // block_size].long()
        k = k_cache[blk, pos % block_size].float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v_cache[blk, pos % block_size].float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - query_len, seq_len)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + query_len].float(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if bias is not None:
            distance = (q_pos[:, None] - pos[None, :]).clamp(min=0)  # [Lq, S]
            scores = scores + bias[:, bias.shape[1] - 1 - distance]
        mask = pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= pos[None, :] > q_pos[:, None] - window
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[row : row + query_len] = torch.einsum("hqk,khd->qhd", probs, v)
        row += query_len
    return out


def run_decode(
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    window=None,
    max_seq_len=None,
    dtype=torch.float32,
    atol=1e-4,
    softcap=None,
):
    k_cache, v_cache, block_table = make_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = ta.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        torch.tensor(seq_lens, dtype=torch.int32),
        scale,
        window,
        max_seq_len or max(seq_lens),
        softcap=softcap,
    )
    assert out.shape == q.shape and out.dtype == dtype
    ref = reference(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        [1] * len(seq_lens),
        scale,
        window,
        softcap=softcap,
    )
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=atol)


def run_prefill(
    seq_lens,
    query_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    window=None,
    dtype=torch.float32,
    atol=1e-4,
    softcap=None,
):
    k_cache, v_cache, block_table = make_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    cu_seqlens_q = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
    )
    scale = head_dim**-0.5
    out = ta.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        torch.tensor(seq_lens, dtype=torch.int32),
        scale,
        window,
        max(query_lens),
        softcap=softcap,
    )
    assert out.shape == q.shape and out.dtype == dtype
    ref = reference(
        q, k_cache, v_cache, block_table, seq_lens, query_lens, scale, window, softcap=softcap
    )
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=atol)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [
        (2, 2, 64, 16),  # G=1
        (4, 2, 80, 16),  # G=2
        (4, 1, 96, 32),  # G=4, MQA
        (8, 1, 128, 16),  # G=8, MQA
        (2, 1, 256, 32),  # G=2, head_dim 256
    ],
)
def test_decode_gqa_head_dims_multiple_splits(num_heads, num_kv_heads, head_dim, block_size):
    # partitions of 32 keys: 1..3 splits per row, ragged across block boundaries
    run_decode([1, 17, 33, 70], num_heads, num_kv_heads, head_dim, block_size)


@pytest.mark.parametrize("window", [None, 12])
def test_softcap_decode_and_prefill(window):
    """Gemma 2's logit soft-capping (a small cap, so that it changes most scores), with and without
    a window, decode over several splits and prefill after a cached prefix."""
    run_decode([1, 17, 40], 4, 2, 32, 16, window=window, softcap=0.5)
    run_prefill([9, 40], [9, 13], 4, 2, 32, 16, window=window, softcap=0.5)


def test_decode_single_split_writes_out_directly():
    run_decode([5, 16, 31], 4, 2, 64, 16)  # max_seq_len <= 32: one split, no reduce launch


def test_decode_max_seq_len_larger_than_actual():
    run_decode([3, 40], 4, 2, 64, 16, max_seq_len=200)  # most partitions empty (lse = -inf)


def test_decode_max_seq_len_smaller_than_actual_is_still_exact():
    run_decode(
        [3, 90], 2, 1, 64, 16, max_seq_len=40
    )  # 2 splits: partitions of 48 keys for the long row


def test_decode_split_cap_lengthens_partitions(monkeypatch):
    monkeypatch.setattr(ta, "DECODE_MAX_SPLITS", 3)
    run_decode([2, 40, 100, 130], 4, 2, 64, 16, max_seq_len=300)  # 3 splits of 32, 48 keys
    run_decode([100, 130], 4, 2, 64, 16, window=50, max_seq_len=300)


@pytest.mark.parametrize("window", [1, 8, 20, 64])
def test_decode_sliding_window(window):
    run_decode([1, 9, 37, 70], 4, 2, 64, 16, window=window, max_seq_len=96)


def test_decode_padding_rows_are_finite():
    seq_lens = [0, 1, 21, 0]
    k_cache, v_cache, block_table = make_cache(seq_lens, 1, 64, 16)
    k_cache[0], v_cache[0] = 0.0, 0.0  # the runner's pool is zeroed: the null block is finite
    block_table[[0, 1, 3]] = 0  # padding rows point at the null block
    q = torch.randn(4, 2, 64)
    out = ta.paged_decode_attention(
        q, k_cache, v_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32), 0.125, None, 64
    )
    assert torch.isfinite(out).all()
    assert (out[[0, 3]] == 0).all()
    ref = reference(q[2:3], k_cache, v_cache, block_table[2:3], [21], [1], 0.125, None)
    torch.testing.assert_close(out[2:3], ref, atol=1e-4, rtol=1e-4)


def test_decode_strided_q_and_out_argument():
    seq_lens = [7, 50]
    k_cache, v_cache, block_table = make_cache(seq_lens, 2, 64, 16)
    qkv = torch.randn(2, (4 + 2 + 2) * 64)
    q = qkv[:, : 4 * 64].view(2, 4, 64)  # row stride 512 > H * D
    out_buf = torch.full((2, 4, 64 + 8), 7.0)
    out = out_buf[:, :, :64]
    res = ta.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        torch.tensor(seq_lens, dtype=torch.int32),
        0.125,
        None,
        64,
        out=out,
    )
    assert res.data_ptr() == out.data_ptr()
    torch.testing.assert_close(
        out,
        reference(q, k_cache, v_cache, block_table, seq_lens, [1, 1], 0.125, None),
        atol=1e-4,
        rtol=1e-4,
    )
    assert (out_buf[:, :, 64:] == 7.0).all()


@pytest.mark.parametrize("extra", [0, 9])
def test_decode_bias_by_distance(extra):
    """T5's relative bias: a float32 [H, L] table by distance from the query, added to the scaled
    scores (the CPU kernel's layout); across splits, with GQA."""
    seq_lens = [1, 37, 70, 16]
    k_cache, v_cache, block_table = make_cache(seq_lens, 2, 64, 16)
    q = torch.randn(len(seq_lens), 4, 64)
    bias = torch.randn(4, max(seq_lens) + extra) * 3
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = ta.paged_decode_attention(
        q, k_cache, v_cache, block_table, lens, 1.0, None, bias.shape[1], bias=bias
    )
    ref = reference(
        q, k_cache, v_cache, block_table, seq_lens, [1] * len(seq_lens), 1.0, None, bias
    )
    torch.testing.assert_close(out.float(), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="bias"):
        ta.paged_decode_attention(
            q, k_cache, v_cache, block_table, lens, 1.0, None, max(seq_lens), bias=bias[:, :5]
        )


def test_seq2seq_step_through_triton():
    """An encoder-decoder step on the Triton backend (models/seq2seq.py): every row a decode row of
    the kernel, decoder prefixes and decode rows mixed, self-attention with a per-distance bias and
    cross-attention over the cross blocks, against the reference plan (gathered SDPA)."""
    from kvserve.models.attention.metadata import AttentionMetadata
    from kvserve.models.attention.triton import TritonAttentionBackend
    from kvserve.models.seq2seq import kv_holder, paged_attention, step_plan

    g = torch.Generator().manual_seed(0)
    heads, dim, bs = 4, 32, 4
    holder = kv_holder(heads, dim)
    holder.kv_cache = torch.randn(2, 41, bs, heads, dim, generator=g)
    holder.backend = TritonAttentionBackend()
    query_lens, seq_lens, cross_lens = [1, 5, 1, 3], [7, 5, 12, 9], [6, 3, 13, 8]
    perm = torch.randperm(40, generator=g) + 1
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(10, dtype=torch.int32),
        positions=torch.zeros(10, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 6, 7, 10], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=perm[:16].view(4, 4).int(),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=bs,
        max_query_len=5,
        max_seq_len=12,
        cross_block_table=perm[20:36].view(4, 4),
        cross_lens_cpu=cross_lens,
    )
    q = torch.randn(sum(query_lens), heads, dim, generator=g)
    length = max(seq_lens)
    bias = torch.randn(heads, length, generator=g)
    kernel_plan, ref_plan = step_plan(meta, q.device, kernels=True), step_plan(meta, q.device)
    masks = []
    for r in ref_plan.prefill:
        pos = torch.arange(r.seq_len - r.query_len, r.seq_len)[:, None]
        distance = (pos - torch.arange(r.seq_len)[None, :]).clamp(min=0)
        masks.append(r.causal_mask(q.device) + bias[:, length - 1 - distance])
    keys = ref_plan.self_mask.shape[-1]
    distance = ((ref_plan.self_lens - 1)[:, None] - torch.arange(keys)[None, :]).clamp(
        0, length - 1
    )
    ref_bias = bias[:, length - 1 - distance].permute(1, 0, 2)[:, :, None, :] + ref_plan.self_mask
    for cross in (False, True):
        got = paged_attention(holder, q, kernel_plan, 0.5, cross, [], None if cross else bias)
        ref = paged_attention(holder, q, ref_plan, 0.5, cross, masks, None if cross else ref_bias)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_decode_fp16():  # the interpreter's tl.dot cannot take bf16 (numpy has none): fp16 stands in
    run_decode([9, 45], 4, 2, 64, 16, dtype=torch.float16, atol=5e-3)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [
        (2, 2, 64, 16),
        (4, 2, 80, 32),
        (4, 1, 96, 16),
        (8, 1, 128, 16),
        (2, 1, 256, 16),
    ],
)
def test_prefill_no_prefix(num_heads, num_kv_heads, head_dim, block_size):
    run_prefill([5, 23, 40], [5, 23, 40], num_heads, num_kv_heads, head_dim, block_size)


def test_prefill_cached_prefix_mixed_query_lens():
    # decode rows (query_len 1), chunked-prefill chunks after a cached prefix, and a whole prompt
    run_prefill([30, 19, 45, 12, 1], [1, 19, 13, 1, 1], 4, 2, 64, 16)


@pytest.mark.parametrize("window", [1, 7, 20])
def test_prefill_sliding_window(window):
    run_prefill([30, 19, 45, 3], [1, 19, 26, 2], 4, 2, 64, 16, window=window)


def test_prefill_out_argument_and_untouched_rows():
    seq_lens, query_lens = [10, 20], [4, 20]
    k_cache, v_cache, block_table = make_cache(seq_lens, 1, 64, 32)
    q = torch.randn(26, 2, 64)  # two padding rows past cu_seqlens_q[-1]
    out = torch.full_like(q, 3.0)
    cu_seqlens_q = torch.tensor([0, 4, 24], dtype=torch.int32)
    res = ta.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        torch.tensor(seq_lens, dtype=torch.int32),
        0.125,
        None,
        20,
        out=out,
    )
    assert res is out
    torch.testing.assert_close(
        out[:24],
        reference(q, k_cache, v_cache, block_table, seq_lens, query_lens, 0.125, None)[:24],
        atol=1e-4,
        rtol=1e-4,
    )
    assert (out[24:] == 3.0).all()


def test_prefill_fp16():
    run_prefill([20, 33], [20, 9], 4, 2, 64, 16, dtype=torch.float16, atol=5e-3)


def test_ops_are_registered_custom_ops():
    seq_lens = [3, 18]
    k_cache, v_cache, block_table = make_cache(seq_lens, 1, 64, 16)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(2, 2, 64)
    torch.library.opcheck(
        torch.ops.kvserve.triton_paged_decode_attention.default,
        (q, k_cache, v_cache, block_table, lens, 0.125, None, 40, torch.empty_like(q)),
        test_utils=("test_schema", "test_faketensor"),
    )
    q = torch.randn(4, 2, 64)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.kvserve.triton_paged_prefill_attention.default,
        (q, k_cache, v_cache, block_table, cu, lens, 0.125, 8, 3, torch.empty_like(q)),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_bad_arguments_raise_value_error():
    k_cache, v_cache, block_table = make_cache([4], 2, 64, 16)
    lens = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ta.paged_decode_attention(
            torch.randn(1, 3, 64), k_cache, v_cache, block_table, lens, 0.1, None, 4
        )
    with pytest.raises(ValueError, match="sliding_window"):
        ta.paged_decode_attention(
            torch.randn(1, 4, 64), k_cache, v_cache, block_table, lens, 0.1, 0, 4
        )
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ta.paged_prefill_attention(
            torch.randn(4, 4, 64),
            k_cache,
            v_cache,
            block_table,
            torch.tensor([0, 4, 4], dtype=torch.int32),
            lens,
            0.1,
            None,
            4,
        )


def test_models_import_does_not_import_triton():
    code = "import sys, models, models.attention, models.kernels; print('triton' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )
    assert result.stdout.strip() == "False"


_COMPILE_FOR_SM90 = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvserve.models.kernels import triton_attention as ta

def compile_for_h100(fn, types, consts):
    # as a launch specializes them: pointers, strides and block_size divisible by 16
    options = dict(num_warps=consts.pop("num_warps", 4), num_stages=consts.pop("num_stages", 3))
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n.startswith("stride") or n == "block_size"}
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, consts, kernel.metadata.shared)

for dtype, g, d, window in [(torch.bfloat16, 4, 128, False), (torch.float16, 1, 80, True),
                            (torch.bfloat16, 2, 256, True), (torch.float32, 8, 256, True)]:
    t = "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    common = dict(q_ptr=t, k_ptr=t, v_ptr=t, out_ptr=t, block_table_ptr="*i32", seq_lens_ptr="*i32",
                  qk_scale="fp32")
    block_d = triton.next_power_of_2(d)
    for direct in (False, True):
        compile_for_h100(ta._decode_partition_kernel,
                         dict(common, part_out_ptr="*fp32", part_lse_ptr="*fp32", bias_ptr="*fp32"),
                         dict(G=g, G_PAD=16, HEAD_DIM=d, BLOCK_D=block_d, PARTITION_SIZE=512, HAS_WINDOW=window,
                              HAS_BIAS=direct, DIRECT_OUT=direct, **ta._decode_config(dtype, d)))
    compile_for_h100(ta._decode_reduce_kernel, dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=t),
                     dict(HEAD_DIM=d, BLOCK_D=block_d, SPLIT_TILE=16))
    compile_for_h100(ta._prefill_kernel, dict(common, cu_seqlens_q_ptr="*i32"),
                     dict(G=g, HEAD_DIM=d, BLOCK_D=block_d, HAS_WINDOW=window, **ta._prefill_config(dtype, d, g)))
print("compiled")
"""


def compile_for_sm90(script: str) -> None:
    """Run `script` (which compiles kernels for sm_90 and prints "compiled") in a process without
    the interpreter: Triton's compiler is what it skips. No GPU needed; without ptxas, a skip."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    if result.returncode != 0 and "ptxas" in result.stderr and "not found" in result.stderr:
        pytest.skip("no ptxas in this triton install")
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


def test_kernels_compile_for_h100():
    """The interpreter skips Triton's compiler: compile each kernel for sm_90 (no GPU needed)."""
    compile_for_sm90(_COMPILE_FOR_SM90)
