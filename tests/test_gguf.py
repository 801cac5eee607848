"""GGUF checkpoints (models/gguf_loader.py): tiny files written at test time (tests/gguf_files.py).

kvserve's logits on a GGUF file equal transformers' on the same file, every family and tensor
type; dequantized tensors equal the gguf package's reference exactly; config, tokenizer and
chat template come from the file's metadata; what kvserve does not read is refused by name.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from gguf_files import llama_cpp_permute, make_gguf, make_spm_gguf, tensor_type_of
from kvserve.engine import LLM, AsyncLLM, EngineArgs, SamplingParams
from kvserve.engine.input_processor import load_tokenizer
from kvserve.models.gguf_loader import iter_gguf_tensors
from kvserve.models.hf_config import load_hf_config
from kvserve.models.layers import rope_parameters
from kvserve.models.loader import load_model, resolve_model_path
from test_models import PagedRunner, assert_close, hf_logits, make_prompts

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "phi3")
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
# transformers reads no head_dim from a qwen3 GGUF and no n_positions from a gpt2 one (it keeps
# its defaults), so its model matches the file only at those values; kvserve reads
# `attention.key_length` and `context_length` (test_config_from_metadata).
OVERRIDES = {"qwen3": dict(head_dim=128), "gpt2": dict(n_positions=1024)}


def hf_gguf_model(path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tmp_path, family, tensor_type):
    path = make_gguf(tmp_path, family, tensor_type, **OVERRIDES.get(family, {}))
    model_path = resolve_model_path(str(path))
    config = load_hf_config(model_path)
    model = load_model(
        model_path, config, torch.float32, "cpu", quantization="none"
    )  # transformers' values
    prompts = make_prompts(config.vocab_size, lens=[1, 5, 17])
    runner = PagedRunner(model, block_size=4)
    got = [runner.step([(i, p, 0)])[0] for i, p in enumerate(prompts)]
    assert_close(got, hf_logits(hf_gguf_model(path), prompts))


K_QUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q4_K_M", "Q5_K_M")  # single types and llama.cpp's mixes
LEGACY_TYPES = (
    "Q4_1",
    "Q5_0",
    "Q5_1",
)  # what llama.cpp's K-quant files fall back to for rows not of 256
WIDE = dict(hidden_size=256, intermediate_size=256)  # K-quant blocks hold 256 weights of a row


@pytest.mark.parametrize("tensor_type", [*TENSOR_TYPES, *LEGACY_TYPES, *K_QUANT_TYPES])
def test_dequantized_tensors_equal_reference(tmp_path, tensor_type):
    """Each tensor, with llama.cpp's q/k permutation put back, is the reference's values exactly;
    unquantized (F32) it is the original checkpoint's weight exactly. A mix has each matrix in
    its own type (Q4_K_M: Q6_K value, FFN-down and output matrices, Q4_K the rest)."""
    path = make_gguf(
        tmp_path, "llama", tensor_type, **(WIDE if tensor_type in K_QUANT_TYPES else {})
    )
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        if len(t.shape) == 2:
            assert t.tensor_type.name == tensor_type_of(t.name, tensor_type), t.name
    original = load_file(tmp_path / "hf" / "model.safetensors")
    loaded = dict(iter_gguf_tensors(path))
    assert set(loaded) == set(original)
    for t, (name, w) in zip(reader.tensors, loaded.items(), strict=True):
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = 4 if name.endswith("q_proj.weight") else 2
            w = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
        assert w.dtype == torch.float32 and torch.equal(w.reshape(want.shape), want), name
        if tensor_type == "F32":
            assert torch.equal(loaded[name], original[name]), name
        elif tensor_type == "Q8_0":  # near the original: the names and permutation round-trip
            torch.testing.assert_close(loaded[name], original[name], atol=0.02, rtol=0.02)


@pytest.mark.parametrize("tensor_type", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0", "Q4_1"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
def test_k_quant_logits_match_transformers(tmp_path, family, tensor_type):
    """K-quant files (and the legacy types their mixes fall back to), held dequantized: the
    logits equal transformers' on the same file."""
    path = make_gguf(tmp_path, family, tensor_type, **WIDE, **OVERRIDES.get(family, {}))
    model_path = resolve_model_path(str(path))
    config = load_hf_config(model_path)
    model = load_model(model_path, config, torch.float32, "cpu", quantization="none")
    prompts = make_prompts(config.vocab_size, lens=[1, 5, 17])
    runner = PagedRunner(model, block_size=4)
    got = [runner.step([(i, p, 0)])[0] for i, p in enumerate(prompts)]
    assert_close(got, hf_logits(hf_gguf_model(path), prompts))


def test_config_from_metadata(tmp_path):
    path = make_gguf(tmp_path, "qwen3", "F32")  # head_dim 32 != hidden / heads
    config = load_hf_config(str(path))
    want = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert config.architectures == ["Qwen3ForCausalLM"]
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
    ):
        # GGUF stores floats as float32: equal up to that rounding
        assert getattr(config, key) == pytest.approx(getattr(want, key), rel=1e-7), key
    assert config.rope_parameters["rope_theta"] == pytest.approx(
        want.rope_parameters["rope_theta"], rel=1e-7
    )
    gpt2 = load_hf_config(str(make_gguf(tmp_path / "gpt2", "gpt2")))
    assert gpt2.tie_word_embeddings is True and gpt2.n_positions == 512


def test_tied_embeddings_match_safetensors(tmp_path):
    """A file without `output.weight` ties the head to the embedding; F32 GGUF and the
    safetensors checkpoint it was written from give the same logits."""
    path = make_gguf(tmp_path, "llama", "F32", tie_word_embeddings=True)
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    prompts = make_prompts(384, lens=[3, 9])
    logits = []
    for model_path in (str(path), str(tmp_path / "hf")):
        config = load_hf_config(model_path)
        assert config.tie_word_embeddings
        runner = PagedRunner(load_model(model_path, config, torch.float32, "cpu"), block_size=4)
        logits.append([runner.step([(i, p, 0)])[0] for i, p in enumerate(prompts)])
    assert_close(*logits)


def test_tokenizer_and_chat_template_from_file(tmp_path):
    path = make_gguf(tmp_path, "llama", "Q8_0")
    tokenizer = load_tokenizer(str(path))
    want = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Café, naïve: 東京 🚀 def add(a, b):"
    assert tokenizer.encode(text) == want.encode(text)
    chat = [{"role": "user", "content": "Hello Zürich"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == want.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_tokenizer_splits_text_as_the_file_says(tmp_path, family):
    """A file's pre-tokenizer type picks how text is split before BPE (llama.cpp and transformers'
    conversion both follow it); a qwen2 file whose vocabulary was not made with Qwen's split (here
    the test tokenizer's default one) must not get Qwen2's tokenizer class, which always splits the
    Qwen way (digits one by one, a symbol glued to the letters after it)."""
    path = make_gguf(tmp_path, family, "Q8_0")
    ours = load_tokenizer(str(path))
    want = transformers.AutoTokenizer.from_pretrained(
        tmp_path, gguf_file=path.name
    )  # the file, converted
    for text in [
        "numbers 1234567890 3.14159",
        "code: def f(x):\n    return x**2  # comment",
        "(hello) [world]",
    ]:
        split = ours.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
        assert split == want.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text), text
        assert ours.encode(text) == want.encode(text), text


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_sentencepiece_file_tokenizes_as_sentencepiece(tmp_path, add_space_prefix):
    """A Llama 2 / Mistral-style file (tokenizer model "llama"): the ids of the SentencePiece model
    its vocabulary came from (what llama.cpp reproduces), text that starts with spaces included,
    and the same text back."""
    path, sp = make_spm_gguf(tmp_path, add_space_prefix)
    tokenizer = load_tokenizer(str(path))
    for text in [
        " ",
        "  ",
        "Hello world",
        " Hello world",
        "   Hello",
        "Hello\n  world",
        "naïve café 🦙 12345",
        "\tTabs\there",
        "def f(x):\n    return x",
        "Ελλάδα!",
    ]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tokenizer.decode(ids) == sp.decode(ids), text


@pytest.mark.parametrize("pre, ignore_merges", [("llama-bpe", True), ("default", False)])
def test_llama3_files_take_whole_words_before_merges(tmp_path, pre, ignore_merges):
    """Llama 3's pre-tokenizer type (and a few others) take a word found whole in the vocabulary
    without merging, as llama.cpp and Llama 3's own tokenizer do."""
    path = make_gguf(tmp_path, "llama", "Q8_0", tokenizer_pre=pre)
    model = json.loads(load_tokenizer(str(path)).backend_tokenizer.to_str())["model"]
    assert model["ignore_merges"] is ignore_merges


@pytest.mark.parametrize(
    "pre, add_bos, starts_with_bos",
    [
        (
            "llama-bpe",
            None,
            True,
        ),  # Llama 3's type: BOS unless the file says otherwise (older files do not say)
        ("llama-bpe", False, False),
        ("default", None, False),
        ("default", True, True),
    ],
)
def test_bos_as_the_file_or_its_pre_tokenizer_type_says(tmp_path, pre, add_bos, starts_with_bos):
    path = make_gguf(tmp_path, "llama", "F32", tokenizer_pre=pre, add_bos=add_bos)
    tokenizer = load_tokenizer(str(path))
    ids = tokenizer.encode("hi there")
    assert (ids[0] == tokenizer.bos_token_id) is starts_with_bos
    assert ids[starts_with_bos:] == tokenizer.encode("hi there", add_special_tokens=False)


def test_model_path_resolution(tmp_path):
    path = make_gguf(tmp_path, "llama", "F32")
    shutil.rmtree(tmp_path / "hf")
    assert resolve_model_path(str(tmp_path)) == str(path)  # a directory holding one .gguf
    shutil.copy(path, tmp_path / "other.gguf")
    with pytest.raises(ValueError, match="2 GGUF files"):
        resolve_model_path(str(tmp_path))


def test_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ValueError,
        match=r"unsupported GGUF architecture 'falcon'.*llama, qwen2, qwen3, phi3, qwen3moe, gpt2, gemma2, gemma3",
    ):
        load_hf_config(str(path))
    with pytest.raises(ValueError, match="'falcon'"):
        list(iter_gguf_tensors(path))


def test_unsupported_tensor_type_is_refused(tmp_path):
    path = make_gguf(
        tmp_path, "llama", "MXFP4"
    )  # a type the gguf package writes and kvserve does not read
    with pytest.raises(
        ValueError, match=r"GGUF tensor '[a-z_.]+weight' has type MXFP4.*supported tensor types"
    ):
        list(iter_gguf_tensors(path))


ENGINE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=32, max_num_seqs=2)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_llm_generates_from_gguf(tmp_path):
    """`LLM(model=file.gguf)` end to end: greedy tokens equal transformers' on the same file (held
    dequantized, as transformers holds it)."""
    path = make_gguf(tmp_path, "llama", "Q8_0")
    llm = LLM(str(path), quantization="none", **ENGINE)
    try:
        prompt = "The quick brown fox"
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    ids = load_tokenizer(str(path)).encode(prompt)
    with torch.no_grad():
        want = (
            hf_gguf_model(path)
            .generate(
                torch.tensor([ids]),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :]
            .tolist()
        )
    assert list(out.token_ids) == want


def test_async_engine_serves_a_directory_holding_a_gguf(tmp_path):
    """What `kvserve serve --model dir` runs: the engine resolves the directory's one .gguf."""
    path = make_gguf(tmp_path, "qwen2", "Q4_0")
    shutil.rmtree(tmp_path / "hf")
    prompt = "Once upon a time"

    async def main(engine):
        return [out async for out in engine.generate(prompt, GREEDY, "r0")][-1].outputs[0]

    engine = AsyncLLM(EngineArgs(model=str(tmp_path), **ENGINE))
    try:
        got = asyncio.run(main(engine))
    finally:
        asyncio.run(engine.shutdown())
    llm = LLM(str(path), **ENGINE)
    try:
        want = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert got.token_ids == want.token_ids and got.text == want.text


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_truncated_or_corrupt_file_is_a_clear_error(tmp_path, damage):
    """Nothing half-loads: the error names the file and says what is wrong with it."""
    good = make_gguf(tmp_path, "llama", "Q8_0").read_bytes()
    blob = {
        "truncated": good[: len(good) // 2],
        "garbage": b"GGUF" + bytes(range(256)) * 8,
        "empty": b"",
    }[damage]
    path = tmp_path / f"{damage}.gguf"
    path.write_bytes(blob)
    with pytest.raises(ValueError, match=r"is not a readable GGUF file \(truncated or corrupt\?\)"):
        LLM(str(path), **ENGINE)


def test_metadata_is_converted_once_and_read_without_torch(tmp_path, monkeypatch):
    """transformers converts a file's config and tokenizer once (per path, size and mtime); later
    loads read the cached directory, and a process that only needs the tokenizer (the API server)
    does not import torch for it."""
    import subprocess
    import sys

    from kvserve.models import gguf_metadata

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = make_gguf(tmp_path, "qwen2", "Q8_0")
    first = gguf_metadata.gguf_metadata_dir(path)
    assert (first / "config.json").is_file() and (first / "tokenizer.json").is_file()
    monkeypatch.setattr(gguf_metadata, "_convert", lambda *a: pytest.fail("converted twice"))
    assert gguf_metadata.gguf_metadata_dir(path) == first
    assert load_hf_config(str(path)).architectures == ["Qwen2ForCausalLM"]
    code = (
        "import sys; from kvserve.engine.input_processor import load_tokenizer; "
        f"t = load_tokenizer({str(path)!r}); print('torch' in sys.modules, len(t.encode('hello world')) > 0)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["KVSERVE_CACHE_DIR"] = str(tmp_path / "cache")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.split() == ["False", "True"], result.stderr[-2000:]
    stat = path.stat()
    os.utime(
        path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9)
    )  # a changed file is converted again
    monkeypatch.undo()
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert gguf_metadata.gguf_metadata_dir(path) != first


def test_metadata_without_a_writable_cache(tmp_path, monkeypatch):
    """A cache directory that cannot be made (here: a file is in its way): converted into a
    temporary directory instead, and the file still loads."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(blocker / "cache"))
    path = make_gguf(tmp_path, "llama", "F16")
    assert load_hf_config(str(path)).architectures == ["LlamaForCausalLM"]
    assert not (blocker / "cache").exists()


def test_llama3_rope_scaling_is_read_back_from_rope_freqs(tmp_path, caplog):
    """A Llama 3.x file keeps its rope scaling only as per-frequency divisors (`rope_freqs.weight`):
    kvserve recovers Llama 3's parameters from them (transformers drops them), so the file gives the
    logits of the safetensors checkpoint it was written from. Divisors of another rule: a warning."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    path = make_gguf(tmp_path, "llama", "F32", rope_parameters=rope)
    config = load_hf_config(str(path))
    assert rope_parameters(config) == rope
    prompts = make_prompts(384, lens=[3, 40])
    logits = []
    for model_path in (str(path), str(tmp_path / "hf")):
        runner = PagedRunner(
            load_model(model_path, load_hf_config(model_path), torch.float32, "cpu"), block_size=4
        )
        logits.append([runner.step([(i, p, 0)])[0] for i, p in enumerate(prompts)])
    assert_close(*logits)
    from kvserve.models.gguf_metadata import llama3_rope_parameters

    assert (
        llama3_rope_parameters(np.full(8, 2.0, dtype=np.float32) ** np.arange(8), 10000.0, 16)
        is None
    )
