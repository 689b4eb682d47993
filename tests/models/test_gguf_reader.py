"""The GGUF reader pagedserve opens files with (`gguf_file.open_gguf`, arrays parsed one slice
per item) gives the gguf library's own reader's fields and tensors, part for part."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pagedserve.models import gguf_file
from tests.utils.paged import bundled_gguf


def _assert_same(path: str) -> None:
    fast, plain = gguf_file.open_gguf(path), gguf.GGUFReader(path)
    assert type(fast) is not gguf.GGUFReader  # the fast path is the one compared
    assert list(fast.fields) == list(plain.fields)
    for name, b in plain.fields.items():
        a = fast.fields[name]
        assert (a.offset, a.types, a.data) == (b.offset, b.types, b.data), name
        assert a.contents() == b.contents(), name
        assert [(x.dtype, bytes(x)) for x in a.parts] == [(x.dtype, bytes(x)) for x in b.parts]
    assert fast.data_offset == plain.data_offset
    assert len(fast.tensors) == len(plain.tensors)
    for a, b in zip(fast.tensors, plain.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
            (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert np.array_equal(a.shape, b.shape)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


def test_arrays_of_every_kind(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_array("test.strings", ["a", "", "héllo wörld", "x" * 300, "<|im_end|>"])
    writer.add_array("test.empty", [])
    writer.add_array("test.ints", [3, -1, 2**20])
    writer.add_array("test.floats", [0.5, -2.25, 1e-6])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])  # arrays of arrays: the library's path
    writer.add_string("test.after", "read at the right offset")
    writer.add_uint32("test.last", 7)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 4)).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.standard_normal(4).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_same(path)
    fields = gguf_file.open_gguf(path).fields
    assert fields["test.strings"].contents()[2] == "héllo wörld"
    assert fields["test.after"].contents() == "read at the right offset"


@pytest.mark.slow  # 3.5 s of the library's reader
def test_bundled_model_file():
    _assert_same(str(bundled_gguf()))


def test_a_cut_or_foreign_file_is_a_clear_error(tmp_path):
    """A GGUF cut short (an interrupted download) or another file named .gguf: one line naming
    the file (they were numpy's reshape error and gguf's bare 'GGUF magic invalid')."""
    whole = tmp_path / "whole.gguf"
    writer = gguf.GGUFWriter(str(whole), "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cut, foreign = tmp_path / "cut.gguf", tmp_path / "foreign.gguf"
    cut.write_bytes(whole.read_bytes()[:-100])
    foreign.write_text("not a model")
    with pytest.raises(ValueError, match=r"cannot read the GGUF file .*cut\.gguf: .*is it "
                                         r"complete\?"):
        gguf_file.open_gguf(str(cut))
    with pytest.raises(ValueError, match=r"foreign\.gguf is not a GGUF file"):
        gguf_file.open_gguf(str(foreign))
