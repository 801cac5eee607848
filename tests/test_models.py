"""models/: logits equal transformers' through the paged KV cache; loader and registry errors.

Everything runs on the CPU in fp32 with tiny random checkpoints (tests/checkpoints.py).
The paged-cache steps are driven by `PagedRunner`, a minimal stand-in for
engine/worker/runner.py that builds `AttentionMetadata` by hand with shuffled block ids.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from checkpoints import FAMILIES, make_checkpoint
from kvserve.models.attention import (
    Attention,
    AttentionMetadata,
    forward_context,
    get_forward_context,
    torch_ref,
)
from kvserve.models.hf_config import CheckpointConfig, load_hf_config
from kvserve.models.loader import (
    get_eos_token_ids,
    get_max_model_len,
    load_model,
    resolve_model_path,
)
from kvserve.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

ATOL = 1e-4
# Mixed prompt lengths: 1 token up to several blocks, some beyond Mistral's sliding window (24).
PROMPT_LENS = [1, 3, 4, 9, 17, 26, 41]


@dataclass
class PagedRunner:
    """Drives a model step by step over a paged KV cache, like engine/worker/runner.py would."""

    model: torch.nn.Module
    block_size: int
    num_blocks: int = 128
    seed: int = 0
    device: str = "cpu"
    tables: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        dtype = next(self.model.parameters()).dtype
        for module in self.model.modules():
            if isinstance(module, Attention):
                shape = (2, self.num_blocks, self.block_size, module.num_kv_heads, module.head_dim)
                # Unwritten slots hold a huge finite value: attending to one unmasked ruins the logits.
                # (Masked slots must be finite: SDPA turns 0 * NaN into NaN.)
                module.kv_cache = torch.full(shape, 1e4, dtype=dtype, device=self.device)
        self.free = list(range(1, self.num_blocks))  # block 0 = null block
        random.Random(self.seed).shuffle(self.free)  # non-contiguous, unordered block ids

    def step(self, chunks: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """chunks: (request id, new token ids, number of cached tokens) -> logits per chunk [n, vocab]."""
        bs = self.block_size
        input_ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for req_id, tokens, num_cached in chunks:
            seq_len = num_cached + len(tokens)
            table = self.tables.setdefault(req_id, [])
            while len(table) * bs < seq_len:
                table.append(self.free.pop())
            pos = list(range(num_cached, seq_len))
            input_ids += tokens
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            query_lens.append(len(tokens))
            seq_lens.append(seq_len)
            tables.append(table)
        max_blocks = max(len(t) for t in tables) + 1  # + 1: trailing null-block padding
        meta = make_meta(
            self.model,
            query_lens,
            seq_lens,
            slots,
            positions,
            [t + [0] * (max_blocks - len(t)) for t in tables],
            bs,
            self.device,
        )
        with torch.inference_mode(), forward_context(meta):
            hidden = self.model(
                torch.tensor(input_ids, device=self.device),
                torch.tensor(positions, device=self.device),
            )
            logits = self.model.compute_logits(hidden).float().cpu()
        return list(logits.split(query_lens))


def make_meta(
    model,
    query_lens: list[int],
    seq_lens: list[int],
    slots: list[int],
    positions: list[int],
    tables: list[list[int]],
    block_size: int,
    device: str = "cpu",
) -> AttentionMetadata:
    """The runner's metadata, in the index dtype of the model's attention backend."""
    index = next(m for m in model.modules() if isinstance(m, Attention)).backend.index_dtype

    def t(values):
        return torch.tensor(values, dtype=index, device=device)

    return AttentionMetadata(
        slot_mapping=t(slots),
        positions=torch.tensor(positions, device=device),
        cu_seqlens_q=t([0] + query_lens).cumsum(0).to(index),
        seq_lens=t(seq_lens),
        block_table=t(tables),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def make_prompts(vocab_size: int, lens: list[int] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lens]


def hf_logits(hf_model, prompts: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf_model(torch.tensor([p])).logits[0].float() for p in prompts]


def load_pair(path: Path, family: str, **overrides):
    model_dir = make_checkpoint(path, family, **overrides)
    config = load_hf_config(
        model_dir
    )  # as the engine reads it (transformers' AutoConfig for what it cannot)
    model = load_model(model_dir, config, torch.float32, "cpu")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    return model, hf_model, config


@pytest.fixture(
    scope="module",
    params=[(f, b) for f in FAMILIES for b in ("cpu", "torch")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def family_models(request, checkpoint_dirs):
    """(family, attention backend): the CPU kernels' backend and the portable torch reference."""
    family, backend = request.param
    model_dir = checkpoint_dirs[family]  # conftest.py: one tiny checkpoint per family
    config = load_hf_config(model_dir)
    model = load_model(model_dir, config, torch.float32, "cpu", attention_backend=backend)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    prompts = make_prompts(config.vocab_size)
    return family, model, config, prompts, hf_logits(hf_model, prompts)


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=lambda m, i=i: f"request {i}: {m}")


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_whole_prompts_in_one_batch(family_models, block_size):
    _, model, _, prompts, want = family_models
    runner = PagedRunner(model, block_size)
    assert_close(runner.step([(i, p, 0) for i, p in enumerate(prompts)]), want)


def test_prefill_after_cached_prefix(family_models):
    _, model, _, prompts, want = family_models
    runner = PagedRunner(model, block_size=4, seed=1)
    cut = [max(1, len(p) * 2 // 3) if len(p) > 1 else 1 for p in prompts]
    first = runner.step([(i, p[: cut[i]], 0) for i, p in enumerate(prompts)])
    rest = [(i, p[cut[i] :], cut[i]) for i, p in enumerate(prompts) if len(p) > cut[i]]
    second = dict(zip([r[0] for r in rest], runner.step(rest)))
    got = [
        torch.cat([first[i]] + ([second[i]] if i in second else [])) for i in range(len(prompts))
    ]
    assert_close(got, want)


@pytest.mark.parametrize(
    "cpu_chunk_bytes", [None, 1, 3000], ids=["one-sdpa", "row-per-chunk", "few-rows-per-chunk"]
)
def test_mixed_decode_and_chunked_prefill(family_models, cpu_chunk_bytes, monkeypatch):
    """Every step mixes 1-token rows with 5-token prefill chunks; requests drop out as they finish.

    `cpu_chunk_bytes` shrinks the CPU decode chunking (normally 8 MiB) so that the
    decode rows are also attended in several SDPA calls."""
    if cpu_chunk_bytes is not None:
        monkeypatch.setattr(torch_ref, "CPU_DECODE_CHUNK_BYTES", cpu_chunk_bytes)
    _, model, _, prompts, want = family_models
    runner = PagedRunner(model, block_size=4, seed=2)
    chunk_sizes = [5 if i % 3 == 0 else 1 for i in range(len(prompts))]
    done = [0] * len(prompts)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        order = [i for i in range(len(prompts)) if done[i] < len(prompts[i])]
        random.Random(sum(done)).shuffle(order)  # request order in the batch varies by step
        chunks = [(i, prompts[i][done[i] : done[i] + chunk_sizes[i]], done[i]) for i in order]
        for (i, tokens, _), logits in zip(chunks, runner.step(chunks)):
            got[i].append(logits)
            done[i] += len(tokens)
    assert_close([torch.cat(g) for g in got], want)


@pytest.mark.parametrize(
    "family,overrides",
    [
        (
            "llama",
            dict(
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=64,
                )
            ),
        ),
        ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0), rope_theta=500000.0)),
        ("llama", dict(tie_word_embeddings=True)),
        ("llama", dict(num_key_value_heads=1)),  # MQA
        ("qwen2", dict(tie_word_embeddings=True)),
        ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
        ("gpt2", dict(tie_word_embeddings=False, scale_attn_by_inverse_layer_idx=True)),
    ],
    ids=[
        "llama3-rope",
        "linear-rope",
        "llama-tied",
        "mqa",
        "qwen2-tied",
        "qwen2-sliding-layers",
        "gpt2-untied",
    ],
)
def test_config_variants(tmp_path, family, overrides):
    model, hf_model, config = load_pair(tmp_path, family, **overrides)
    assert isinstance(config, CheckpointConfig)  # every variant here is read without transformers
    prompts = make_prompts(config.vocab_size, [2, 11, 30])
    want = hf_logits(hf_model, prompts)
    runner = PagedRunner(model, block_size=4)
    assert_close(
        runner.step([(i, p[:-1], 0) for i, p in enumerate(prompts)]), [w[:-1] for w in want]
    )
    assert_close(
        runner.step([(i, p[-1:], len(p) - 1) for i, p in enumerate(prompts)]),
        [w[-1:] for w in want],
    )
    if family == "llama" and "rope_scaling" in overrides:
        torch.testing.assert_close(
            model.model.rotary_emb.cos_sin_cache[:, 0, : config.head_dim // 2],
            (
                torch.arange(config.max_position_embeddings)[:, None]
                * hf_model.model.rotary_emb.inv_freq
            ).cos(),
        )


def test_forward_context_restores_and_is_required():
    attn = Attention(2, 1, 4, scale=0.5)
    meta = make_meta(attn, [1], [1], [0], [0], [[0]], 4)
    assert get_forward_context() is None
    with pytest.raises(KeyError):
        with forward_context(meta):
            assert get_forward_context() is meta
            raise KeyError
    assert get_forward_context() is None
    with pytest.raises(RuntimeError, match="forward_context"):
        attn(torch.zeros(1, 16))


def test_unsupported_architecture_lists_supported():
    config = transformers.PretrainedConfig(architectures=["FalconForCausalLM"])
    with pytest.raises(ValueError, match="FalconForCausalLM") as err:
        get_model_class(config)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)
    assert set(SUPPORTED_ARCHITECTURES) >= {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "GPT2LMHeadModel",
    }


def _rewrite_weights(src: str, dst: Path, edit) -> str:
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(Path(src) / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_missing_weight_raises_with_name(llama_dir, tmp_path):
    model_dir = _rewrite_weights(
        llama_dir, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")
    )
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(model_dir, config, torch.float32, "cpu")


def test_misshaped_weight_raises_with_shapes(llama_dir, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]

    model_dir = _rewrite_weights(llama_dir, tmp_path / "m", edit)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"up_proj\.weight.*\(127, 64\).*\(128, 64\)"):
        load_model(model_dir, config, torch.float32, "cpu")


def test_unexpected_weight_raises(llama_dir, tmp_path):
    model_dir = _rewrite_weights(
        llama_dir, tmp_path / "m", lambda t: t.update(extra=torch.zeros(2))
    )
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with pytest.raises(ValueError, match="extra"):
        load_model(model_dir, config, torch.float32, "cpu")


def test_pickle_checkpoint_refused(llama_dir, tmp_path):
    (tmp_path / "config.json").write_text(Path(llama_dir, "config.json").read_text())
    torch.save({}, tmp_path / "pytorch_model.bin")
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="safetensors only"):
        load_model(str(tmp_path), config, torch.float32, "cpu")


def test_sharded_checkpoint_loads(llama_dir, tmp_path):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (
        len(list(tmp_path.glob("*.safetensors"))) > 1
        and (tmp_path / "model.safetensors.index.json").exists()
    )
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = load_model(str(tmp_path), config, torch.float32, "cpu")
    prompts = make_prompts(config.vocab_size, [7])
    assert_close(PagedRunner(model, 4).step([(0, prompts[0], 0)]), hf_logits(hf_model, prompts))


def test_load_in_bf16(llama_dir):
    config = transformers.AutoConfig.from_pretrained(llama_dir)
    model = load_model(llama_dir, config, torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        llama_dir, dtype=torch.bfloat16
    ).eval()
    prompts = make_prompts(config.vocab_size, [6, 13])
    got = PagedRunner(model, 4).step([(i, p, 0) for i, p in enumerate(prompts)])
    for g, w in zip(got, hf_logits(hf_model, prompts)):
        assert (g.argmax(-1) == w.argmax(-1)).float().mean() > 0.9
        torch.testing.assert_close(g, w, atol=0.1, rtol=0.05)


def test_checkpoint_facts(llama_dir, tmp_path):
    config = transformers.AutoConfig.from_pretrained(llama_dir)
    assert get_max_model_len(config) == 512
    assert get_max_model_len(transformers.GPT2Config(n_positions=300)) == 300
    im_end = json.loads(Path(llama_dir, "tokenizer.json").read_text())["added_tokens"][2]["id"]
    assert get_eos_token_ids(llama_dir, config) == [0, im_end]  # a list in generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert get_eos_token_ids(str(tmp_path), config) == [7]
    (tmp_path / "generation_config.json").unlink()
    assert get_eos_token_ids(str(tmp_path), config) == [0]  # falls back to config.eos_token_id
    assert resolve_model_path(llama_dir) == llama_dir
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model_path(str(tmp_path / "nope"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_paged_attention_cuda(tmp_path, family, backend):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model_dir = make_checkpoint(tmp_path, family)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, config, torch.float32, "cuda", attention_backend=backend)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    prompts = make_prompts(config.vocab_size)
    want = hf_logits(hf_model, prompts)
    runner = PagedRunner(model, 4, device="cuda")
    first = runner.step([(i, p[:-1], 0) for i, p in enumerate(prompts) if len(p) > 1])
    last = runner.step([(i, p[-1:], len(p) - 1) for i, p in enumerate(prompts)])
    got = [
        torch.cat(([first.pop(0)] if len(p) > 1 else []) + [last[i]]) for i, p in enumerate(prompts)
    ]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=0)  # TF32 may be on for matmuls


def test_default_model_is_deterministic_cached_and_loads(tmp_path):
    from kvserve.models.default_model import (
        DEFAULT_MODEL_NAME,
        build_default_model,
        ensure_default_model,
    )

    model_dir = Path(ensure_default_model(str(tmp_path / "cache")))
    assert model_dir == tmp_path / "cache" / DEFAULT_MODEL_NAME
    assert [p.name for p in model_dir.parent.iterdir()] == [
        DEFAULT_MODEL_NAME
    ]  # temp dir renamed away
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(str(tmp_path / "cache")) == str(model_dir)  # cached: not rebuilt
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime
    build_default_model(tmp_path / "again")
    files = sorted(p.name for p in model_dir.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "again").iterdir())
    for name in files:
        assert (model_dir / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name

    config = transformers.AutoConfig.from_pretrained(model_dir)
    assert get_max_model_len(config) == 2048 and 2000 <= config.vocab_size <= 4096
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) == config.vocab_size
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert get_eos_token_ids(str(model_dir), config) == [tokenizer.eos_token_id, im_end]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    text = "The fox jumped over the moon."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode(text)) < len(text) / 2  # real merges, not bytes

    model = load_model(str(model_dir), config, torch.float32, "cpu")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    prompt = tokenizer.encode("The lion and the mouse")
    assert_close(PagedRunner(model, 16).step([(0, prompt, 0)]), hf_logits(hf_model, [prompt]))
    # A bigram model of the corpus: after "The" it should continue with a word from it.
    logits = PagedRunner(model, 16).step([(0, tokenizer.encode("Once upon a time the"), 0)])[0][-1]
    assert tokenizer.decode(int(logits.argmax())).strip().isalpha()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_hf_bitwise(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from kvserve.models.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 96, generator=g) * 5).to(dtype)
    hf, ours = LlamaRMSNorm(96, eps=1e-6), RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96, generator=g) * 0.5 + 1)
        ours.weight.copy_(hf.weight)
    hf, ours = hf.to(dtype), ours.to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x))


def test_prefill_before_kv_cache_is_assigned(llama_dir):
    """A memory-profiling pass may run prefills before the runner assigns `kv_cache`."""
    config = transformers.AutoConfig.from_pretrained(llama_dir)
    model = load_model(llama_dir, config, torch.float32, "cpu")
    prompts = make_prompts(config.vocab_size, [5, 9])
    want = hf_logits(
        transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32), prompts
    )

    def meta(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
        return make_meta(
            model,
            query_lens,
            seq_lens,
            [0] * sum(query_lens),
            positions,
            [[0] * 4] * len(seq_lens),
            4,
        )

    with torch.inference_mode(), forward_context(meta([5, 9], [5, 9])):
        hidden = model(torch.tensor(prompts[0] + prompts[1]), torch.tensor([*range(5), *range(9)]))
        assert_close(list(model.compute_logits(hidden).split([5, 9])), want)
    with (
        torch.inference_mode(),
        forward_context(meta([1], [6])),
        pytest.raises(RuntimeError, match="kv_cache"),
    ):
        model(torch.tensor([1]), torch.tensor([5]))


def test_cpu_packed_linear_matches_f_linear():
    from kvserve.models.cpu_model import pack_for_cpu
    from kvserve.models.layers import Linear

    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    if pack_for_cpu(layer) == 0:
        pytest.skip("neither kvserve's kernels nor oneDNN's linear packing are available")
    assert layer.packed is not None
    assert layer.weight.numel() == 0
    for rows in (x, x[:1]):  # any batch size works with one packing
        got = layer(rows).float()
        torch.testing.assert_close(got, ref[: len(rows)], atol=0.1, rtol=0.02)
