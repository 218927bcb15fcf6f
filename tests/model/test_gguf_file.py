"""pagedllm's GGUF header reader against the gguf package's GGUFReader: same metadata, same
tensors (names, types, shapes, bytes), on the real default model and on a generated file with
every metadata value type; bad files are clear errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pagedllm.model.gguf_file import GGUFFile
from pagedllm.model.gguf_loader import _open
from pagedllm.model.loader import resolve_model


def _assert_same_as_gguf_reader(path) -> None:
    mine, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert list(mine.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, value in mine.fields.items():
        want = ref.fields[key].contents()
        got = value.tolist() if isinstance(value, np.ndarray) else value
        assert got == want, key
    assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(mine.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def test_the_default_model_reads_as_gguf_reader_reads_it():
    _assert_same_as_gguf_reader(resolve_model(None).path)


def _write_every_kind(path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.strs", ["a", "", "ccc"])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(5).astype(np.float32))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_metadata_type_and_tensor_kind_reads_as_gguf_reader_reads_it(tmp_path):
    path = tmp_path / "kinds.gguf"
    _write_every_kind(path)
    _assert_same_as_gguf_reader(path)
    f = GGUFFile(path)
    assert f.fields["t.strs"] == ["a", "", "ccc"] and f.fields["t.str"] == "héllo"
    assert [t.data.shape for t in f.tensors] == [(3, 64), (2, 32), (5,), (4, 68)]


def test_bad_files_are_clear_errors(tmp_path):
    path = tmp_path / "kinds.gguf"
    _write_every_kind(path)
    raw = path.read_bytes()
    cases = {
        "empty": b"",
        "magic": b"GGML" + raw[4:],
        "version": raw[:4] + (1).to_bytes(4, "little") + raw[8:],
        "header cut": raw[:200],
        "data cut": raw[:-40],
    }
    for name, content in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(content)
        with pytest.raises(ValueError, match="could not read GGUF file"):
            _open(bad)


def test_a_header_cut_inside_the_vocabulary_is_a_clear_error(tmp_path):
    """The string arrays (vocabulary, merges) are read by their own loop: a cut anywhere in them,
    even inside a length field, says "truncated"."""
    source = resolve_model(None).path
    head = open(source, "rb").read(2_000_000)  # the header holds ~49k tokens and ~48k merges
    full = GGUFFile(source)
    assert len(full.fields["tokenizer.ggml.tokens"]) == 49152
    for cut in (300_000, 300_003, 1_000_001, 1_500_000):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(head[:cut])
        with pytest.raises(ValueError, match="truncated GGUF header"):
            GGUFFile(path)
