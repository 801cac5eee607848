"""A Q8_0 / Q4_0 GGUF file's matrices held as its own blocks, read without a float round trip
(models/gguf_blocks.py), against the dequantize-and-quantize path they replace."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_files import make_gguf
from kvserve.models import gguf_loader
from kvserve.models import loader as loader_module
from kvserve.models.gguf_blocks import read_blocks
from kvserve.models.hf_config import load_hf_config
from kvserve.models.loader import load_model
from kvserve.models.parallel import ParallelState
from kvserve.models.quantization import QuantizedLinear, dequantize
from test_quantization import assert_same_bits, logits_of, parse_blocks

QTYPES = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_0": gguf.GGMLQuantizationType.Q4_0}


def random_blocks(rng: np.random.Generator, qtype, n: int, k: int) -> np.ndarray:
    """Raw blocks [n, k / 32 * block bytes] no quantizer would write: q well inside its range,
    scales of any sign and size (a subnormal, a zero), so a round trip through fp32 and back
    would not give them."""
    num_blocks = n * k // 32
    d = rng.standard_normal(num_blocks).astype(np.float16)
    d[:3] = [0.0, -0.0, 3e-7]
    if qtype == QTYPES["Q8_0"]:
        q = rng.integers(-100, 100, (num_blocks, 32)).astype(np.int8).view(np.uint8)
    else:
        q = rng.integers(0, 256, (num_blocks, 16)).astype(np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), q], axis=1)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0"])
def test_read_blocks_are_the_files_bytes(tmp_path, tensor_type):
    """q and d as the file holds them, bit for bit, and q * d the gguf package's values; a 3-D
    stack comes back [E, out, in]."""
    qtype, rng = QTYPES[tensor_type], np.random.default_rng(0)
    path = tmp_path / "blocks.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    raws = {
        "matrix": random_blocks(rng, qtype, 6, 96),
        "stack": random_blocks(rng, qtype, 8, 64).reshape(2, 4, -1),
    }
    for name, raw in raws.items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    for f in (writer.write_header_to_file, writer.write_kv_data_to_file):
        f()
    writer.write_tensors_to_file()
    writer.close()
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    got = read_blocks(tensors["matrix"])
    want_q, want_d = parse_blocks(raws["matrix"], qtype, 6, 96)
    assert got.bits == (8 if tensor_type == "Q8_0" else 4)
    assert_same_bits(got.q, want_q)
    assert_same_bits(got.d, want_d)
    values = gguf.quants.dequantize(tensors["matrix"].data, qtype)
    assert torch.equal(dequantize(got.q, got.d, 32), torch.from_numpy(values))
    experts = read_blocks(tensors["stack"])  # as stacked experts are: [2, 4, 64]
    want_q, want_d = parse_blocks(raws["stack"].reshape(8, -1), qtype, 8, 64)
    assert experts.shape == (2, 4, 64) and experts.d.shape == (2, 4, 2)
    assert_same_bits(experts[1].q, want_q[4:])
    assert_same_bits(experts[1].d, want_d[4:])


def held_weights(model: torch.nn.Module) -> dict[str, object]:
    """Every quantized weight (one per expert of stacked experts), by module name."""
    held = {}
    for name, m in model.named_modules():
        fns = getattr(m, "packed", None)
        for i, fn in enumerate(fns if isinstance(fns, list) else [fns]):
            if isinstance(fn, QuantizedLinear):
                held[f"{name}.{i}"] = fn.weight
        if getattr(m, "quantized", None) is not None:
            held[f"{name}.embedding"] = m.quantized
    return held


def load_both(path, monkeypatch, quantization=None):
    """The model through the direct path, and through dequantize-and-quantize (blocks refused)."""
    config = load_hf_config(str(path))
    direct = load_model(str(path), config, torch.float32, "cpu", quantization=quantization)
    with monkeypatch.context() as m:
        m.setattr(loader_module, "_direct_tensors", lambda *args: set())
        requantized = load_model(str(path), config, torch.float32, "cpu", quantization=quantization)
    return direct, requantized


CASES = [
    ("llama", "Q8_0", {}),  # permuted q/k rows
    ("llama", "Q4_0", {}),
    ("llama", "Q8_0", dict(tie_word_embeddings=True)),  # the head from token_embd
    ("qwen3_moe", "Q8_0", dict(mlp_only_layers=[])),  # stacked experts (llama.cpp's: all sparse)
    ("qwen3_moe", "Q4_0", dict(mlp_only_layers=[])),
    ("gemma3", "Q8_0", {}),
]


@pytest.mark.parametrize("family,tensor_type,overrides", CASES)
def test_direct_blocks_equal_the_round_trip(tmp_path, monkeypatch, family, tensor_type, overrides):
    """A file the gguf package wrote round-trips exactly through fp32 (every block's max |q| is
    127, or its extreme -8), so the blocks read straight from it are the weights the old path
    held, matrix for matrix and logit for logit, and the direct path takes every matrix of the
    file's type."""
    path = make_gguf(tmp_path, family, tensor_type, **overrides)
    taken: list[str] = []
    read = gguf_loader.read_blocks
    monkeypatch.setattr(gguf_loader, "read_blocks", lambda t: taken.append(t.name) or read(t))
    direct, requantized = load_both(path, monkeypatch)
    got, want = held_weights(direct), held_weights(requantized)
    assert got.keys() == want.keys()
    for name, weight in got.items():
        assert_same_bits(weight.data, want[name].data, name)
        assert_same_bits(weight.scales, want[name].scales, name)
        assert (weight.bits, weight.packed) == (want[name].bits, want[name].packed), name
    # every matrix of the file's type but an untied embedding (held in the model dtype) and,
    # from Q4_0, the head (held int8)
    is_tied = "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    expected = {
        t.name
        for t in gguf.GGUFReader(path).tensors
        if t.tensor_type == QTYPES[tensor_type]
        and (t.name != "token_embd.weight" or is_tied and tensor_type == "Q8_0")
        and (t.name != "output.weight" or tensor_type == "Q8_0")
    }
    assert expected and sorted(taken) == sorted(expected)
    prompts = [[1, 5, 9, 2], [7, 3]]
    assert torch.equal(
        logits_of(direct, prompts, torch.float32), logits_of(requantized, prompts, torch.float32)
    )


def test_blocks_that_do_not_round_trip_are_held_as_they_stand(tmp_path, monkeypatch):
    """Scales that are not max |w| / 127 (a block whose largest |q| is below 127): the direct path
    holds the file's blocks exactly; the old path re-derived other scales from their values."""
    path = make_gguf(tmp_path, "llama", "Q8_0")
    rewritten = tmp_path / "halved.gguf"
    halve_q_of(path, rewritten, "blk.0.ffn_down.weight")
    direct, requantized = load_both(rewritten, monkeypatch)
    t = next(t for t in gguf.GGUFReader(rewritten).tensors if t.name == "blk.0.ffn_down.weight")
    n, k = (int(s) for s in reversed(t.shape))
    want_q, want_d = parse_blocks(t.data, QTYPES["Q8_0"], n, k)
    for model, exact in ((direct, True), (requantized, False)):
        q, d = held_weights(model)["model.layers.0.mlp.down_proj.0"].unpack()
        assert torch.equal(q, want_q) == exact and torch.equal(d, want_d) == exact
        assert torch.equal(dequantize(q, d, 32), dequantize(want_q, want_d, 32)) == exact


def halve_q_of(path, out, name: str) -> None:
    """A copy of the file with tensor `name`'s q halved (rounded toward zero), its scales kept."""
    data = bytearray(path.read_bytes())
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    blocks = np.frombuffer(data, np.uint8, t.n_bytes, t.data_offset).reshape(-1, 34).copy()
    blocks[:, 2:] = (blocks[:, 2:].view(np.int8) / 2).astype(np.int8).view(np.uint8)
    data[t.data_offset : t.data_offset + t.n_bytes] = blocks.tobytes()
    out.write_bytes(bytes(data))


@pytest.mark.parametrize("quantization", ["int4", "none"])
def test_other_formats_keep_the_float_path(tmp_path, monkeypatch, quantization):
    """A Q8_0 file served as int4 (bits differ) or unquantized takes no blocks: the same weights as
    the dequantize path."""
    path = make_gguf(tmp_path, "llama", "Q8_0")
    direct, requantized = load_both(path, monkeypatch, quantization)
    prompts = [[1, 5, 9, 2]]
    assert torch.equal(
        logits_of(direct, prompts, torch.float32), logits_of(requantized, prompts, torch.float32)
    )


@pytest.mark.parametrize(
    "family,overrides", [("llama", {}), ("qwen3_moe", dict(mlp_only_layers=[]))]
)
def test_each_rank_takes_its_slice_of_the_blocks(tmp_path, monkeypatch, family, overrides):
    """Tensor parallelism: the weight loaders cut q and d as they cut a float weight (rows, and for
    row-parallel layers whole groups of inputs), so each rank holds what the float path gives it."""
    path = make_gguf(tmp_path, family, "Q8_0", **overrides)
    config = load_hf_config(str(path))
    taken: list[str] = []
    read = gguf_loader.read_blocks
    monkeypatch.setattr(gguf_loader, "read_blocks", lambda t: taken.append(t.name) or read(t))
    for rank in range(2):

        def load(path=path, rank=rank):
            return load_model(
                str(path), config, torch.float32, "cpu", parallel=ParallelState(rank, 2)
            )

        direct = held_weights(load())
        with monkeypatch.context() as m:
            m.setattr(loader_module, "_direct_tensors", lambda *args: set())
            requantized = held_weights(load())
        assert direct.keys() == requantized.keys()
        assert any(".ffn_down" in name for name in taken)  # row-parallel: d cut by groups
        for name, weight in direct.items():
            assert_same_bits(weight.data, requantized[name].data, f"rank {rank} {name}")
            assert_same_bits(weight.scales, requantized[name].scales, f"rank {rank} {name}")
