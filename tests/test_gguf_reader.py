"""models/gguf_reader.py: the reader that parses metadata arrays in bulk builds exactly the
fields and tensors of the gguf package's `GGUFReader`, and transformers' conversion reads the same
config and tokenizer through it."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from gguf_files import make_gguf, make_spm_gguf
from kvserve.models.gguf_metadata import field, open_gguf
from kvserve.models.gguf_reader import GGUFReader, bulk_arrays_everywhere

WIDE = dict(hidden_size=256, intermediate_size=256)


def assert_same_reader(got: gguf.GGUFReader, want: gguf.GGUFReader) -> None:
    assert list(got.fields) == list(want.fields)
    for name, w in want.fields.items():
        g = got.fields[name]
        assert (g.offset, g.name, g.data, g.types) == (w.offset, w.name, w.data, w.types), name
        assert len(g.parts) == len(w.parts), name
        for gp, wp in zip(g.parts, w.parts, strict=True):
            assert gp.dtype == wp.dtype and gp.shape == wp.shape, name
            assert gp.tobytes() == wp.tobytes(), name
        assert g.contents() == w.contents(), name
    assert got.data_offset == want.data_offset and got.alignment == want.alignment
    assert len(got.tensors) == len(want.tensors)
    for g, w in zip(got.tensors, want.tensors, strict=True):
        assert (g.name, g.tensor_type, g.n_elements, g.n_bytes, g.data_offset) == (
            w.name,
            w.tensor_type,
            w.n_elements,
            w.n_bytes,
            w.data_offset,
        )
        assert g.shape.tolist() == w.shape.tolist(), g.name
        assert g.data.dtype == w.data.dtype and g.data.shape == w.data.shape, g.name
        assert g.data.tobytes() == w.data.tobytes(), g.name


def _gguf_with_every_array(tmp_path):
    """A file whose metadata holds an array of each value type, empty ones and nested ones."""
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    vt = gguf.GGUFValueType
    for name, values, sub in [
        ("u8", [0, 1, 255], vt.UINT8),
        ("i8", [-128, 0, 127], vt.INT8),
        ("u16", [0, 65535], vt.UINT16),
        ("i16", [-32768, 7], vt.INT16),
        ("u32", [1, 2, 2**32 - 1], vt.UINT32),
        ("i32", [-(2**31), 5], vt.INT32),
        ("u64", [2**64 - 1, 0], vt.UINT64),
        ("i64", [-(2**63), 3], vt.INT64),
        ("f32", [0.5, -1.25, float("inf")], vt.FLOAT32),
        ("f64", [1e300, -0.0], vt.FLOAT64),
        ("bool", [True, False, True], vt.BOOL),
        ("str", ["", "a", "naïve café ▁x", "\x00"], vt.STRING),
    ]:
        writer.add_key_value(f"test.{name}", values, vt.ARRAY, sub_type=sub)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_array("test.nested_str", [["a", "bc"], ["d"]])
    writer.add_string("test.scalar_str", "x")
    writer.add_float32("test.scalar_f32", 2.5)
    writer.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_array_type_reads_as_the_package_reads_it(tmp_path):
    path = _gguf_with_every_array(tmp_path)
    assert_same_reader(GGUFReader(path), gguf.GGUFReader(path))
    assert field(open_gguf(path), "test.str") == ["", "a", "naïve café ▁x", "\x00"]
    assert field(open_gguf(path), "test.u64") == [2**64 - 1, 0]


def test_empty_arrays_read_as_the_package_reads_them(tmp_path):
    """Written by hand: the package's writer refuses empty arrays, its reader takes them."""

    def key(name: str) -> bytes:
        return struct.pack("<Q", len(name)) + name.encode()

    array = gguf.GGUFValueType.ARRAY
    kvs = [
        key(f"test.{name}") + struct.pack("<IIQ", array, sub, 0)
        for name, sub in [("str", gguf.GGUFValueType.STRING), ("f32", gguf.GGUFValueType.FLOAT32)]
    ]
    path = tmp_path / "empty.gguf"
    path.write_bytes(struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, 0, len(kvs)) + b"".join(kvs))
    assert_same_reader(GGUFReader(path), gguf.GGUFReader(path))
    assert field(GGUFReader(path), "test.str", []) == []


@pytest.mark.parametrize(
    "family, tensor_type, overrides",
    [
        ("llama", "Q4_K_M", WIDE),
        ("gemma3", "Q8_0", {}),
        ("phi3", "Q5_0", {}),
        ("qwen3_moe", "Q4_0", {}),
    ],
)
def test_model_files_read_as_the_package_reads_them(tmp_path, family, tensor_type, overrides):
    path = make_gguf(tmp_path, family, tensor_type, **overrides)
    assert_same_reader(GGUFReader(path), gguf.GGUFReader(path))


def test_sentencepiece_scores_read_as_the_package_reads_them(tmp_path):
    path, _ = make_spm_gguf(tmp_path)
    assert_same_reader(GGUFReader(path), gguf.GGUFReader(path))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_transformers_converts_the_same_config_and_tokenizer(tmp_path, family):
    path = make_gguf(tmp_path, family, "Q8_0")
    want = load_gguf_checkpoint(str(path))
    with bulk_arrays_everywhere():
        got = load_gguf_checkpoint(str(path))
    assert gguf.GGUFReader is not GGUFReader  # put back
    assert got == want and len(got["tokenizer"]["tokens"]) > 100


def test_truncated_string_array_is_a_clear_error(tmp_path):
    path = _gguf_with_every_array(tmp_path)
    data = path.read_bytes()
    cut = data.index("naïve".encode())  # inside the string array's elements
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        open_gguf(path)
