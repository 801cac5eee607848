"""models/kernels/triton_moe.py (the experts' grouped GEMM) on the CPU under Triton's interpreter,
against the torch path of models/moe.py; and the MoE families end to end with the Triton ops."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

pytest.importorskip("numpy")
pytest.importorskip("triton")

from checkpoints import MOE_FAMILIES, make_checkpoint  # noqa: E402
from kvserve.models.kernels import triton_moe  # noqa: E402
from kvserve.models.kernels.triton_ops import TritonFusedOps  # noqa: E402
from kvserve.models.loader import load_model  # noqa: E402
from kvserve.models.moe import FusedExperts, group_by_expert  # noqa: E402
from test_models import PagedRunner, assert_close, hf_logits, make_prompts  # noqa: E402
from test_triton_attention import compile_for_sm90  # noqa: E402


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,n,k",
    [
        (1, 2, 8, 64, 64),  # batch-1 decode: two tiles, the rest empty
        (5, 2, 8, 70, 96),  # N and K not multiples of the blocks
        (40, 3, 6, 128, 32),  # more rows than one tile per expert
        (90, 1, 4, 16, 48),  # the large-row tile size
    ],
)
def test_grouped_gemm_matches_per_row_matmuls(num_tokens, top_k, num_experts, n, k):
    g = torch.Generator().manual_seed(num_tokens)
    w = torch.randn(num_experts, n, k, generator=g)
    ids = torch.randint(
        0, num_experts - 1, (num_tokens, top_k), generator=g
    )  # the last expert never chosen
    x = torch.randn(num_tokens, k, generator=g)
    order, tokens, counts = group_by_expert(ids, num_experts)
    rows = x[tokens]  # [P, K] sorted by expert
    got = triton_moe.grouped_gemm(rows, w, counts)
    want = torch.einsum("pk,pnk->pn", rows.double(), w[ids.flatten()[order]].double())
    assert got.shape == (num_tokens * top_k, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


def test_tile_table_never_straddles_experts():
    counts = torch.tensor([0, 17, 3, 0, 16])
    expert, first, stop = triton_moe.tile_table(counts, block_m=16, num_rows=36)
    real = expert < 5
    assert expert[real].tolist() == [1, 1, 2, 4] and first[real].tolist() == [0, 16, 17, 20]
    assert stop[real].tolist() == [17, 17, 20, 36] and len(expert) == 3 + 5


def test_fused_experts_match_the_torch_path():
    torch.manual_seed(0)
    experts = FusedExperts(num_experts=8, hidden_size=64, intermediate_size=48, hidden_act="silu")
    experts.gate_up_proj.weight.data.normal_()
    experts.down_proj.weight.data.normal_()
    x = torch.randn(9, 64)
    weights, ids = torch.rand(9, 2), torch.stack([torch.randperm(8)[:2] for _ in range(9)])
    want = experts(x, weights, ids)  # the torch path: one F.linear per active expert
    experts.ops = (
        TritonFusedOps()
    )  # what the loader binds with the Triton backend: the grouped GEMM
    calls = []
    gemm = triton_moe.grouped_gemm
    triton_moe.grouped_gemm = lambda *args: (calls.append(1), gemm(*args))[1]
    try:
        got = experts(x, weights, ids)
    finally:
        triton_moe.grouped_gemm = gemm
    assert len(calls) == 2  # one launch per projection, all experts together
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_bad_arguments_are_value_errors():
    w = torch.zeros(4, 8, 16)
    with pytest.raises(ValueError, match="w must be"):
        triton_moe.grouped_gemm(torch.zeros(3, 8), w, torch.tensor([3, 0, 0, 0]))
    with pytest.raises(ValueError, match="counts must be"):
        triton_moe.grouped_gemm(torch.zeros(3, 16), w, torch.tensor([3]))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_models_with_the_triton_ops_match_transformers(tmp_path, family):
    model_dir = make_checkpoint(tmp_path, family)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, config, torch.float32, "cpu", attention_backend="triton")
    sparse = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert sparse and all(
        mlp.experts.ops.name == "triton" for mlp in sparse
    )  # the grouped GEMM path
    prompts = make_prompts(config.vocab_size, [1, 9])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    got = PagedRunner(model, block_size=4).step([(i, p, 0) for i, p in enumerate(prompts)])
    assert_close(got, hf_logits(hf, prompts))


_COMPILE_FOR_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvserve.models.kernels import triton_moe as tm

fn = tm._grouped_gemm_kernel
for t in ("bf16", "fp16", "fp32"):
    for bm in (16, 64):
        consts = dict(IEEE=t == "fp32", BM=bm, BN=64, BK=32)
        types = dict(x_ptr="*" + t, w_ptr="*" + t, y_ptr="*" + t, tile_expert_ptr="*i32", tile_start_ptr="*i32",
                     tile_stop_ptr="*i32")
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
        triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=3))
print("compiled")
"""


def test_kernel_compiles_for_h100():
    """The interpreter skips Triton's compiler (and bf16): compile every variant for sm_90, no GPU needed."""
    compile_for_sm90(_COMPILE_FOR_SM90)
