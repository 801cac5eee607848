"""Mixture-of-experts families (models/moe.py, qwen3_moe.py, mixtral.py, qwen2_moe.py) against transformers.

Tiny random checkpoints (tests/checkpoints.py): Qwen3-MoE (3 layers, the middle one dense through
`mlp_only_layers`), Mixtral, and Qwen2-MoE (a shared expert, the first layer dense); fp32 on the
CPU: logits through the paged cache, the engine's greedy tokens and log-probs under chunked
prefill, prefix hits and preemption, routing (ties included) op for op; the CPU kernels (bf16,
int8, int4) per expert; GGUF round trips. The Triton grouped GEMM is in tests/test_triton_moe.py,
tensor parallelism in tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from checkpoints import MOE_FAMILIES, make_checkpoint
from kvserve.models import cpu_ops
from kvserve.models.hf_config import load_hf_config
from kvserve.models.loader import load_model
from kvserve.models.moe import FusedExperts, SparseMoeBlock, TopKRouter, group_by_expert
from kvserve.models.quantization import QuantizedLinear, reference_linear
from test_engine import assert_greedy_matches, assert_no_leaks, greedy, make_llm
from test_engine import make_prompts as engine_prompts
from test_models import PagedRunner, assert_close, hf_logits, make_prompts


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    dirs = {family: make_checkpoint(root / family, family) for family in MOE_FAMILIES}
    dirs |= {
        f"{family}-fused": make_checkpoint(root / f"{family}-fused", family, fused_experts=True)
        for family in MOE_FAMILIES
    }
    return dirs


def load(model_dir: str, dtype: torch.dtype = torch.float32, **kw) -> torch.nn.Module:
    return load_model(model_dir, load_hf_config(model_dir), dtype, "cpu", **kw)


def hf_model(model_dir: str) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def chunked_logits(
    model: torch.nn.Module, prompts: list[list[int]], chunk: int = 5
) -> list[torch.Tensor]:
    """Every prompt prefilled in chunks of `chunk` tokens, all prompts in each step (each chunk
    attends to the cached tokens before it)."""
    runner = PagedRunner(model, block_size=4)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for start in range(0, max(map(len, prompts)), chunk):
        step = [
            (i, p[start : start + chunk], start) for i, p in enumerate(prompts) if start < len(p)
        ]
        for (i, _, _), logits in zip(step, runner.step(step)):
            got[i].append(logits)
    return [torch.cat(parts) for parts in got]


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_match_transformers(moe_dirs, family, backend, layout):
    model_dir = moe_dirs[family if layout == "per-expert" else f"{family}-fused"]
    model = load(model_dir, attention_backend=backend)
    prompts = make_prompts(model.config.vocab_size, lens=[1, 4, 9, 17, 26])
    assert_close(chunked_logits(model, prompts), hf_logits(hf_model(model_dir), prompts))


def test_dense_and_sparse_layers(moe_dirs):
    qwen = load(moe_dirs["qwen3_moe"])
    assert [type(layer.mlp).__name__ for layer in qwen.model.layers] == [
        "SparseMoeBlock",
        "LlamaMLP",
        "SparseMoeBlock",
    ]
    qwen2 = load(moe_dirs["qwen2_moe"])
    assert [type(layer.mlp).__name__ for layer in qwen2.model.layers] == [
        "LlamaMLP",
        "SparseMoeBlock",
        "SparseMoeBlock",
    ]
    assert qwen2.model.layers[1].mlp.shared_expert.gate_up_proj.weight.shape == (2 * 96, 64)
    experts = qwen.model.layers[0].mlp.experts
    assert experts.gate_up_proj.weight.shape == (
        8,
        2 * 64,
        64,
    ) and experts.down_proj.weight.shape == (8, 64, 64)
    mixtral = load(moe_dirs["mixtral"])
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in mixtral.model.layers)


@pytest.mark.parametrize(
    "setting",
    [
        dict(max_num_batched_tokens=5),  # chunked prefill mixed with decodes
        dict(num_kv_blocks=16),  # preempted and recomputed
    ],
)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_engine_greedy_and_logprobs_match_transformers(moe_dirs, family, setting):
    path = moe_dirs[family]
    llm = make_llm(path, **setting)
    prompts = engine_prompts(llm.engine.info.vocab_size)
    prompts += [prompts[-1][:24] + p for p in prompts[:2]]  # a shared 24-token prefix: cache hits
    outs = llm.generate(prompts, greedy(logprobs=2), use_tqdm=False)
    assert_greedy_matches(path, prompts, outs, check_logprobs=True)
    stats = llm.engine.stats()
    if "num_kv_blocks" in setting:
        assert stats.num_preemptions_total > 0
    assert_no_leaks(llm)


# ---- routing ----


def hf_router(family: str, num_experts: int, hidden: int, top_k: int, norm: bool):
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

        config = transformers.MixtralConfig(
            hidden_size=hidden, num_local_experts=num_experts, num_experts_per_tok=top_k
        )
        return MixtralTopKRouter(config)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = transformers.Qwen3MoeConfig(
        hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=norm
    )
    return Qwen3MoeTopKRouter(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "family,norm", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]
)
def test_routing_is_transformers_own_ties_included(family, norm, dtype):
    e, h, k = 8, 32, 2
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(e, h, generator=g)
    weight[5] = weight[2]  # experts 2 and 5 always tie,
    weight[6] = weight[3] = weight[1]  # and 1, 3 and 6 three ways
    x = torch.randn(64, h, generator=g)
    x[:8] = 0  # all logits equal: every expert ties
    ref = hf_router(family, e, h, k, norm).to(dtype)
    ref.weight.data.copy_(weight)
    ours = TopKRouter(e, h, k, renormalize=norm, weights_in_model_dtype=family == "qwen3_moe").to(
        dtype
    )
    ours.weight.data.copy_(weight)
    with torch.no_grad():
        _, want_weights, want_ids = ref(x.to(dtype))
        got_weights, got_ids = ours(x.to(dtype))
    assert torch.equal(got_ids, want_ids)
    assert got_weights.dtype == want_weights.dtype and torch.equal(got_weights, want_weights)
    tied = torch.isin(got_ids[8:], torch.tensor([1, 2, 3, 5, 6])).any()
    assert tied  # the constructed ties were reached


def test_group_by_expert_sorts_pairs_stably():
    ids = torch.tensor([[3, 0], [0, 2], [3, 1]])
    order, tokens, counts = group_by_expert(ids, num_experts=5)
    assert ids.flatten()[order].tolist() == [0, 0, 1, 2, 3, 3]
    assert tokens.tolist() == [0, 1, 2, 1, 0, 2] and counts.tolist() == [2, 1, 1, 2, 0]


def test_every_expert_pass_equals_the_grouped_one():
    """The CUDA-graph-safe pass (every expert on every token, unchosen ones weighted 0) is the same sum."""
    torch.manual_seed(0)
    experts = FusedExperts(num_experts=6, hidden_size=32, intermediate_size=16, hidden_act="silu")
    experts.gate_up_proj.weight.data.normal_()
    experts.down_proj.weight.data.normal_()
    x, weights, ids = (
        torch.randn(5, 32),
        torch.rand(5, 2),
        torch.stack([torch.randperm(6)[:2] for _ in range(5)]),
    )
    torch.testing.assert_close(
        experts.every_expert(x, weights, ids), experts(x, weights, ids), atol=1e-5, rtol=1e-5
    )


# ---- the CPU kernels ----

needs_kernels = pytest.mark.skipif(
    not cpu_ops.load() or not cpu_ops.has_fast_bf16(), reason="no CPU kernel set on this machine"
)


def counting(experts: FusedExperts) -> list[int]:
    """Record which expert each per-expert matmul call is for."""
    calls: list[int] = []
    for proj in (experts.gate_up_proj, experts.down_proj):
        proj.packed = [
            (lambda fn, e: lambda x: (calls.append(e), fn(x))[1])(fn, e)
            for e, fn in enumerate(proj.packed)
        ]
    return calls


def routed_input(experts: FusedExperts, dtype: torch.dtype, num_tokens: int = 7):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, experts.gate_up_proj.in_features, generator=g).to(dtype)
    ids = torch.stack(
        [torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(num_tokens)]
    )
    weights = torch.rand(num_tokens, 2, generator=g)
    return x, weights / weights.sum(-1, keepdim=True), ids


@needs_kernels
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_experts_run_the_kernels_per_active_expert(moe_dirs, quantization):
    model = load(moe_dirs["mixtral"], torch.bfloat16, quantization=quantization)
    experts = model.model.layers[0].mlp.experts
    assert all(
        isinstance(fn, QuantizedLinear) and fn.weight.packed for fn in experts.gate_up_proj.packed
    )
    x, weights, ids = routed_input(experts, torch.bfloat16)
    want = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(len(x)):  # the kernel's exact definition per (token, expert), float64
        for slot in range(2):
            e = int(ids[t, slot])
            h = reference_linear(x[t : t + 1], experts.gate_up_proj.packed[e].weight)
            a = experts.activation(h.to(torch.bfloat16))
            want[t] += weights[t, slot] * reference_linear(a, experts.down_proj.packed[e].weight)[0]
    calls = counting(experts)
    got = experts(x, weights, ids)
    assert sorted(calls) == sorted(
        2 * ids.unique().tolist()
    )  # one call per active expert and projection
    torch.testing.assert_close(got.double(), want, atol=0.02 * want.abs().max().item(), rtol=0.02)


@needs_kernels
def test_bf16_experts_run_the_packed_kernels(moe_dirs):
    packed = load(moe_dirs["qwen3_moe"], torch.bfloat16)
    plain = load(moe_dirs["qwen3_moe"], torch.float32)
    experts, ref = packed.model.layers[0].mlp.experts, plain.model.layers[0].mlp.experts
    assert (
        isinstance(experts.gate_up_proj.packed, list) and experts.gate_up_proj.weight.numel() == 0
    )
    x, weights, ids = routed_input(experts, torch.bfloat16)
    calls = counting(experts)
    got = experts(x, weights.to(torch.bfloat16), ids)
    assert sorted(calls) == sorted(2 * ids.unique().tolist())
    want = ref(x.float(), weights, ids)
    torch.testing.assert_close(got.float(), want, atol=0.02 * want.abs().max().item(), rtol=0.02)


@needs_kernels
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_cpu_kernel_models_stay_close_to_transformers(moe_dirs, family, quantization):
    """bf16 and int8/int4 end to end; MoE layers keep the Python forward (the C++ stack declines them)."""
    from kvserve.models import cpu_stack

    model = load(moe_dirs[family], torch.bfloat16, quantization=quantization)
    reason = cpu_stack.why_not(model)
    assert reason and (
        family == "qwen2_moe" or "not a dense Llama MLP" in reason
    )  # (Qwen2-MoE: layer 0 dense)
    prompts = make_prompts(model.config.vocab_size, lens=[5, 17])
    got = PagedRunner(model, block_size=4).step([(i, p, 0) for i, p in enumerate(prompts)])
    want = hf_logits(hf_model(moe_dirs[family]), prompts)
    # mean error, as a share of the logits' spread: a token whose k-th and (k+1)-th experts nearly tie
    # may route differently once rounded, which moves its logits (and only its) much more
    tol = {None: 0.01, "int8": 0.02, "int4": 0.08}[quantization]
    got, want = torch.cat(got), torch.cat(want)
    assert (got - want).abs().mean() < tol * want.abs().max()
    assert (got - want).abs().max() < 0.35 * want.abs().max()


# ---- GGUF ----


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gguf_loads_to_the_safetensors_logits(tmp_path, family, tensor_type):
    """qwen3moe files, and Mixtral as llama.cpp writes it (arch `llama` with `ffn_*_exps` stacks and an
    `ffn_gate_inp` router); a Q8_0 file serves what the safetensors model quantized to int8 does."""
    from gguf_files import make_gguf

    overrides = (
        {"mlp_only_layers": []} if family == "qwen3_moe" else {}
    )  # llama.cpp's qwen3moe: all sparse
    path = make_gguf(tmp_path, family, tensor_type, **overrides)
    config = load_hf_config(str(path))
    assert config.architectures == [
        {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[family]
    ]
    quantization = "int8" if tensor_type == "Q8_0" else "none"
    from_gguf = load_model(str(path), config, torch.float32, "cpu")  # the file's own format
    assert from_gguf.weights_report.method == quantization
    from_safetensors = load(
        checkpoint_of_file_values(path, tmp_path / "hf", tmp_path / "values"),
        quantization=quantization,
    )
    prompts = make_prompts(config.vocab_size, lens=[3, 17])
    got = PagedRunner(from_gguf, block_size=4).step([(i, p, 0) for i, p in enumerate(prompts)])
    want = PagedRunner(from_safetensors, block_size=4).step(
        [(i, p, 0) for i, p in enumerate(prompts)]
    )
    assert_close(got, want)


def checkpoint_of_file_values(gguf_path, hf_dir, out) -> str:
    """A safetensors checkpoint of the GGUF file's (dequantized) values, under the names it loads as."""
    from safetensors.torch import save_file

    from kvserve.models.gguf_loader import iter_gguf_tensors

    out.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_file(
        {name: w.clone() for name, w in iter_gguf_tensors(gguf_path)},
        str(out / "model.safetensors"),
    )
    return str(out)


def test_bad_expert_checkpoints_are_refused(tmp_path):
    path = make_checkpoint(tmp_path / "m", "mixtral")
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{path}/model.safetensors")
    tensors["model.layers.0.block_sparse_moe.experts.9.w1.weight"] = tensors.pop(
        "model.layers.0.block_sparse_moe.experts.7.w1.weight"
    )
    save_file(tensors, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match="expert"):
        load(path)


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_each_rank_holds_its_slice_of_every_expert(moe_dirs, layout):
    """Tensor parallelism (tp=2 equals tp=1 end to end: tests/test_tensor_parallel.py): gate and up rows
    and down columns of each expert split like a dense MLP's; the router is whole on every rank."""
    from kvserve.models.parallel import ParallelState

    model_dir = moe_dirs["mixtral" if layout == "per-expert" else "mixtral-fused"]
    config = load_hf_config(model_dir)
    full = load(model_dir).model.layers[1].mlp
    ranks = [
        load_model(model_dir, config, torch.float32, "cpu", parallel=ParallelState(r, 2))
        .model.layers[1]
        .mlp
        for r in range(2)
    ]
    inter = config.intermediate_size
    gate_up = full.experts.gate_up_proj.weight  # [E, 2I, H]
    for r, mlp in enumerate(ranks):
        half = slice(r * inter // 2, (r + 1) * inter // 2)
        assert torch.equal(
            mlp.experts.gate_up_proj.weight,
            torch.cat([gate_up[:, :inter][:, half], gate_up[:, inter:][:, half]], dim=1),
        )
        assert torch.equal(mlp.experts.down_proj.weight, full.experts.down_proj.weight[:, :, half])
        assert torch.equal(mlp.gate.weight, full.gate.weight)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_active_bytes_counts_the_models_parameters(moe_dirs, family, capsys):
    from benchmarks.moe_active_bytes import load_config, main, moe_shape

    model = load(moe_dirs[family])
    matrices = sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.dim() >= 2 and "embed_tokens" not in name and "lm_head" not in name
    )
    shape = moe_shape(load_config(moe_dirs[family]))
    assert shape.total == matrices
    assert shape.experts_read(1) == pytest.approx(2) and shape.experts_read(10**6) == pytest.approx(
        8
    )
    assert (
        main([moe_dirs[family], "--batch", "1,8"]) == 0
        and "experts/layer" in capsys.readouterr().out
    )


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
def test_active_bytes_of_a_gguf_file_are_its_tensors_bytes(tmp_path, tensor_type, capsys):
    """Every tensor but the looked-up embedding is read each step, experts k of E per layer at batch 1."""
    from benchmarks.moe_active_bytes import gguf_bytes, main
    from gguf_files import make_gguf
    from kvserve.models.gguf_metadata import open_gguf

    path = make_gguf(tmp_path, "qwen3_moe", tensor_type)
    counts = gguf_bytes(path)
    tensors = open_gguf(path).tensors
    experts = sum(int(t.n_bytes) for t in tensors if "_exps." in t.name)
    tied = not any(
        t.name == "output.weight" for t in tensors
    )  # then the embedding is the head, read whole
    others = sum(
        int(t.n_bytes)
        for t in tensors
        if "_exps." not in t.name and (tied or t.name != "token_embd.weight")
    )
    assert counts.dense == others and counts.expert * counts.shape.num_experts == pytest.approx(
        experts
    )
    k, e = counts.shape.top_k, counts.shape.num_experts
    assert counts.step_bytes(1) == pytest.approx(others + experts * k / e)
    assert counts.step_bytes(10**6) == pytest.approx(others + experts)
    assert main([str(path), "--batch", "1,64"]) == 0 and "GiB/step" in capsys.readouterr().out
