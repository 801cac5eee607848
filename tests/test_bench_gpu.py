"""Smoke test of benchmarks/bench_gpu.py on the CPU with the tiny shape and shrunk cases (speeds are not checked)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from benchmarks import bench_gpu
from benchmarks.llama_shapes import (
    LLAMA_SHAPES,
    kv_bytes_per_token,
    shape_config,
    weight_bytes_per_step,
    write_llama_checkpoint,
)

ROW_FIELDS = {
    "tok_s",
    "elapsed_s",
    "num_steps",
    "ms_per_step",
    "ideal_ms_per_step",
    "measured_over_ideal",
}


def test_bench_gpu_tiny_on_cpu_writes_every_field(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = [
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--small",
        "--cases",
        "a,c",
        "--model-dir",
        str(tmp_path / "m"),
        "--out",
        str(out),
        "--hf-batch",
        "4",
        "--skip-hf",
        "c",
        "--profile-tokens",
        "4",
    ]
    assert bench_gpu.main(argv) == 0
    printed = capsys.readouterr().out
    assert "bandwidth" in printed and "meas/ideal" in printed
    results = json.loads(out.read_text())
    assert results["shape"] == "tiny" and results["errors"] == {}
    assert results["hbm_bandwidth_gb_s"] > 0 and results["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert results["kvserve_info"]["cuda_graphs"] is False
    a, c = results["cases"]["a"], results["cases"]["c"]
    assert (a["num_requests"], a["prompt_tokens"], a["output_tokens"]) == (1, 16, 8)
    assert set(a["systems"]) == {
        "kvserve",
        "kvserve-eager",
        "hf-eager",
    }  # no compile on CPU by default
    assert set(c["systems"]) == {"kvserve"}
    for row in [*a["systems"].values(), *c["systems"].values()]:
        assert ROW_FIELDS <= row.keys() and row["tok_s"] > 0 and row["measured_over_ideal"] > 0
    assert (
        a["systems"]["kvserve"]["num_decode_steps"] == 7
    )  # the first token comes from the prefill step
    hf = a["systems"]["hf-eager"]
    assert (hf["batch_size"], hf["num_batches"], hf["total_batches"], hf["output_tokens_run"]) == (
        1,
        1,
        1,
        8,
    )
    assert c["num_requests"] == 8 and 8 * 4 <= c["output_tokens"] <= 8 * 16
    profile = results["kvserve_profile"]  # on the CPU: no kernels to list, the step count only
    assert (
        profile["num_steps"] == 4
        and profile["decode_wall_ms_per_step"] > 0
        and "top_kernels" in profile
    )


def test_hf_budget_runs_at_least_one_batch_and_counts_the_rest(tmp_path):
    """transformers stops starting batches once the budget is spent; the JSON says how many ran."""
    import torch

    model_dir = write_llama_checkpoint(tmp_path / "m", "tiny")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16
    ).eval()
    prompts, outs = bench_gpu.make_case("c", 512, small=True, seed=0)
    row = bench_gpu.run_hf(model, prompts, outs, 2, 1e-9, 1000, 10, 1e9)
    assert (row["num_batches"], row["total_batches"]) == (1, 4)
    assert row["output_tokens_run"] == sum(outs[:2]) and row["num_steps"] == max(outs[:2])


def test_checkpoint_is_sharded_named_like_hf_and_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "benchmarks.llama_shapes.SHARD_BYTES", 100_000
    )  # several shards from the tiny shape
    path = write_llama_checkpoint(tmp_path / "m", "tiny")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    config = transformers.AutoConfig.from_pretrained(path)
    names = set()
    for name in files:
        with safe_open(path / name, "pt") as f:
            names |= set(f.keys())
    assert names == set(index["weight_map"]) and "lm_head.weight" in names  # tiny is untied
    assert (
        index["metadata"]["total_size"] == weight_bytes_per_step(config) + 2 * 512 * 64
    )  # + the embedding
    assert kv_bytes_per_token(config) == 256
    mtime = (path / files[0]).stat().st_mtime_ns
    write_llama_checkpoint(path, "tiny")  # complete and same recipe: not rewritten
    assert (path / files[0]).stat().st_mtime_ns == mtime


def test_real_shapes_and_bad_arguments(capsys):
    one_b, eight_b = LLAMA_SHAPES["llama-1b"], LLAMA_SHAPES["llama-8b"]
    assert (one_b["hidden_size"], one_b["num_hidden_layers"], one_b["intermediate_size"]) == (
        2048,
        16,
        8192,
    )
    assert one_b["tie_word_embeddings"] and not eight_b["tie_word_embeddings"]
    assert (eight_b["hidden_size"], eight_b["num_hidden_layers"], eight_b["intermediate_size"]) == (
        4096,
        32,
        14336,
    )
    config = transformers.LlamaConfig(**eight_b)
    assert (
        14.9e9 < weight_bytes_per_step(config) < 15.1e9
    )  # 8.03B params minus the 0.53B embedding, bf16
    assert kv_bytes_per_token(config) == 131072
    with pytest.raises(SystemExit):
        bench_gpu.main(["--shape", "tiny", "--device", "cpu", "--cases", "a,z"])
    assert "unknown case(s) ['z']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown shape 'llama-70b'"):
        write_llama_checkpoint("/nonexistent", "llama-70b")


@pytest.mark.parametrize(
    "shape, params", [("gemma3-1b", (0.99e9, 1.01e9)), ("qwen3-moe-6l", (4.35e9, 4.37e9))]
)
def test_other_family_shapes_build_their_transformers_model(tmp_path, shape, params):
    """Gemma 3 and Qwen3-MoE shapes: the real config's parameter count; shrunk, a checkpoint that
    transformers and kvserve load with the same architecture (the layers' kinds for Gemma 3)."""
    from kvserve.models.hf_config import load_hf_config

    config = transformers.AutoConfig.for_model(
        **{k: v for k, v in shape_config(shape).items() if k != "architectures"}
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert params[0] < sum(p.numel() for p in model.parameters()) < params[1]
    small = dict(hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=512)
    if shape == "qwen3-moe-6l":
        small.update(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=2
        )
    path = write_llama_checkpoint(tmp_path / "m", shape, **small)
    hf = transformers.AutoConfig.from_pretrained(path)
    ours = load_hf_config(str(path))
    assert ours.architectures == shape_config(shape)["architectures"]
    if shape == "gemma3-1b":
        assert hf.layer_types.count("full_attention") == 4 and hf.layer_types[5] == "full_attention"
        assert hf.sliding_window == 512 and hf.num_key_value_heads == 1
    else:
        assert (
            hf.num_experts,
            hf.num_experts_per_tok,
            hf.num_hidden_layers,
            hf.moe_intermediate_size,
        ) == (8, 2, 2, 32)
