"""The one-pass GGUF parser against the gguf package's own reader (the reference): the same metadata values and
the same tensor table and bytes, on the default model and on a written file holding every value type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from deepserve.loader.gguf_file import GGUFFile
from deepserve.loader.gguf_loader import default_model_path, read_field


def assert_same_as_gguf_reader(path: str) -> GGUFFile:
    ours, reference = GGUFFile(path), gguf.GGUFReader(path, "r")
    keys = [k for k in reference.fields if not k.startswith("GGUF.")]   # the reader lists the header as fields too
    assert list(ours.fields) == keys
    for key in keys:
        expected = read_field(reference, key)
        assert ours.fields[key] == expected and type(ours.fields[key]) is type(expected), key
    assert len(ours.tensors) == len(reference.tensors)
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert (mine.name, mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == \
               (theirs.name, theirs.tensor_type, theirs.n_elements, theirs.n_bytes, theirs.data_offset)
        assert mine.shape.tolist() == theirs.shape.tolist()
        assert (mine.data.shape, mine.data.dtype) == (theirs.data.shape, theirs.data.dtype), mine.name
        assert np.array_equal(np.asarray(mine.data).view(np.uint8), np.asarray(theirs.data).view(np.uint8))
    return ours


def test_default_model_reads_as_the_gguf_package_reads_it():
    ours = assert_same_as_gguf_reader(default_model_path())
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152


def write_every_type(path: str, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("q4_1", q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_kind(tmp_path, alignment):
    path = str(tmp_path / "every.gguf")
    write_every_type(path, alignment)
    ours = assert_same_as_gguf_reader(path)
    assert ours.fields["t.str"] == "héllo ✓" and ours.fields["t.strs"] == ["a", "", "ü"]
    assert ours.fields["t.u64"] == 2**63 + 5 and ours.fields["t.bool"] is True
    assert ours.data_offset % (alignment or 32) == 0


def test_a_truncated_or_foreign_file_is_a_clear_error(tmp_path):
    path = tmp_path / "every.gguf"
    write_every_type(str(path))
    whole = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:200])                     # inside the metadata
    with pytest.raises(ValueError, match="truncated"):
        GGUFFile(str(cut))
    cut.write_bytes(whole[:-10])                     # inside the last tensor's data
    with pytest.raises(ValueError, match="runs past the end"):
        GGUFFile(str(cut))
    other = tmp_path / "other.bin"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(other))
