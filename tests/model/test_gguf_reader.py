"""Reading GGUF files: tensors come back as written, and every bad file is refused with an
error that names the file and the problem."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402
from test_gguf_files import (  # noqa: E402
    ARCHITECTURES,
    Shapes,
    expected_values,
    gguf_name,
    write_tiny_gguf,
)

from asyncengine.gguf import (  # noqa: E402
    SUPPORTED_TYPES,
    GGMLType,
    GGUFError,
    read_gguf,
)
from asyncengine.gguf.ggml_types import BLOCK_LAYOUT  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_type_numbers_and_block_layout_match_gguf_package() -> None:
    for t in GGMLType:
        assert Q[t.name] == t
    for t in SUPPORTED_TYPES:
        assert gguf.GGML_QUANT_SIZES[Q(t)] == BLOCK_LAYOUT[t]


@pytest.mark.parametrize(
    ("arch", "weight_type"),
    [("llama", Q.Q8_0), ("mistral", Q.Q4_0), ("qwen2", Q.F16), ("qwen3", Q.BF16),
     ("llama", Q.Q4_1), ("qwen3", Q.Q5_0), ("qwen2", Q.Q5_1)],
)  # fmt: skip
def test_tensors_read_back_as_written(tmp_path: Path, arch: str, weight_type: Q) -> None:
    tiny = write_tiny_gguf(tmp_path / "m.gguf", arch, weight_type=weight_type, embed_type=Q.Q8_0)
    model = read_gguf(tiny.path)
    assert set(model.tensors) == set(tiny.weights)
    for hf_name, t in model.tensors.items():
        assert t.name == gguf_name(hf_name)
        assert t.shape == tiny.weights[hf_name].shape  # outermost first, as in HF
        assert t.ggml_type == tiny.types[hf_name]
        order = t.hf_row_order()
        assert (order is not None) == (
            arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight"))
        )
        if t.ggml_type in (GGMLType.F32, GGMLType.F16):
            got = np.asarray(t.view(), dtype=np.float32)
        elif t.ggml_type == GGMLType.BF16:
            got = (np.asarray(t.view(), dtype=np.uint32) << 16).view(np.float32)
        else:  # whole rows of blocks, gathered into HF order before dequantizing
            got = quants.dequantize(t.hf_rows(), Q(t.ggml_type)).reshape(t.shape)
            order = None
        if order is not None:
            got = got[order]
        want = expected_values(tiny, hf_name)
        if t.ggml_type == GGMLType.BF16:  # rounded to bfloat16 by the writer
            np.testing.assert_allclose(got, want, rtol=1 / 128, atol=1e-30)
        else:
            np.testing.assert_array_equal(got, want, err_msg=hf_name)
    model.close()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quant_files_read(tmp_path: Path, qtype: Q) -> None:
    """A Q4_K_M-like mix: K-quant weights (random blocks), Q8_0 embeddings, F32 norms."""
    shapes = Shapes(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64)
    tiny = write_tiny_gguf(
        tmp_path / "k.gguf", "qwen3", weight_type=qtype, embed_type=Q.Q8_0, shapes=shapes
    )
    reader = {t.name: t for t in gguf.GGUFReader(tiny.path).tensors}
    model = read_gguf(tiny.path)
    for t in model.tensors.values():
        assert t.nbytes == reader[t.name].n_bytes
        assert t.data().tobytes() == np.asarray(reader[t.name].data).tobytes()
    down = model.tensors["model.layers.0.mlp.down_proj.weight"]
    assert down.ggml_type == qtype and down.data().shape == (256, 2 * BLOCK_LAYOUT[qtype][1])


def test_tensors_are_views_of_the_file(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "qwen3", weight_type=Q.Q8_0)
    model = read_gguf(tiny.path)
    t = model.tensors["model.layers.1.mlp.down_proj.weight"]
    data = t.data()
    assert not data.flags.owndata and not data.flags.writeable
    assert data.shape == (64, 128 // 32 * 34)  # (rows, whole Q8_0 blocks of a row)
    raw = tiny.path.read_bytes()[t.offset : t.offset + t.nbytes]
    assert data.tobytes() == raw
    assert t.offset % 32 == 0


# --- bad files -------------------------------------------------------------------------------


def _error(path: Path, pattern: str) -> None:
    with pytest.raises(GGUFError, match=pattern) as info:
        read_gguf(path)
    assert str(path) in str(info.value)


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "good.gguf", "llama", weight_type=Q.Q8_0).path


def _patched(good: Path, name: str, data: bytes) -> Path:
    out = good.with_name(name)
    out.write_bytes(data)
    return out


@pytest.mark.parametrize("keep", [0, 10, 23, 200, 2000])
def test_truncated_header_or_metadata(good: Path, keep: int) -> None:
    _error(_patched(good, "cut.gguf", good.read_bytes()[:keep]), "truncated")


def test_truncated_data_section(good: Path) -> None:
    _error(_patched(good, "cut.gguf", good.read_bytes()[:-100]), "runs past the end of the file")


def test_bad_magic(good: Path) -> None:
    data = bytearray(good.read_bytes())
    data[:4] = b"GGML"
    _error(_patched(good, "magic.gguf", bytes(data)), "not a GGUF file")


@pytest.mark.parametrize(("version", "pattern"), [(1, "version 1"), (4, "version 4"),
                                                  (3 << 24, "big-endian")])  # fmt: skip
def test_bad_version(good: Path, version: int, pattern: str) -> None:
    data = bytearray(good.read_bytes())
    data[4:8] = struct.pack("<I", version)
    _error(_patched(good, "version.gguf", bytes(data)), pattern)


def _info_offset_field(data: bytes, tensor: str) -> int:
    """Byte position of `tensor`'s offset field in the tensor table (2-D tensors)."""
    name = tensor.encode()
    pos = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, pos)
    return pos + 4 + 8 * n_dims + 4


def _with_offset(good: Path, tensor: str, offset: int) -> Path:
    data = bytearray(good.read_bytes())
    struct.pack_into("<Q", data, _info_offset_field(bytes(data), tensor), offset)
    return _patched(good, "offsets.gguf", bytes(data))


def test_tensor_offset_past_the_end(good: Path) -> None:
    _error(
        _with_offset(good, "blk.1.attn_q.weight", 1 << 40), "'blk.1.attn_q.weight'.*past the end"
    )


def test_tensor_offset_misaligned(good: Path) -> None:
    _error(_with_offset(good, "blk.1.attn_q.weight", 96 + 4), "not a multiple of the alignment")


def test_tensors_overlap(good: Path) -> None:
    _error(_with_offset(good, "blk.1.attn_q.weight", 0), "overlap")


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.Q2_K, Q.Q3_K, Q.TQ1_0, Q.IQ4_NL, Q.Q8_1])
def test_unsupported_tensor_type(tmp_path: Path, qtype: Q) -> None:
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    cols = 256 if block > 1 else 64
    raw = np.zeros((8, cols // block * nbytes), dtype=np.uint8)
    path = write_tiny_gguf(
        tmp_path / "iq.gguf", "llama", extra_tensors={"blk.0.attn_q.weight.x": (raw, qtype)}
    ).path
    with pytest.raises(GGUFError) as info:
        read_gguf(path)
    message = str(info.value)
    assert "blk.0.attn_q.weight.x" in message and qtype.name in message
    assert "it runs F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("arch", ["gpt2", "phi3", "gemma2", "qwen2moe"])
def test_unsupported_architecture(tmp_path: Path, arch: str) -> None:
    path = write_tiny_gguf(tmp_path / "a.gguf", "llama", file_arch=arch).path
    _error(path, re.escape(f"architecture {arch!r} is not supported") + ".*llama, mistral")


def test_no_tokenizer(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "notok.gguf", "qwen2", tokenizer=False).path
    _error(path, "carries no tokenizer")


def test_unknown_tensor_is_refused(tmp_path: Path) -> None:
    experts = np.zeros((4, 64), dtype=np.float32)
    path = write_tiny_gguf(
        tmp_path / "moe.gguf",
        "llama",
        extra_tensors={"blk.0.ffn_gate_exps.weight": (experts, Q.F32)},
    ).path
    _error(path, "'blk.0.ffn_gate_exps.weight' has no counterpart")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_missing_tensor_is_refused(tmp_path: Path, arch: str) -> None:
    tiny = write_tiny_gguf(tmp_path / "full.gguf", arch)
    # Rename a tensor in place (same length): its slot is now unknown and one is missing.
    data = tiny.path.read_bytes().replace(b"blk.1.ffn_up.weight", b"blk.9.ffn_up.weight")
    _error(_patched(tiny.path, "missing.gguf", data), "missing.*model.layers.1.mlp.up_proj")


def test_empty_and_non_gguf_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _error(empty, "truncated")
    text = tmp_path / "text.gguf"
    text.write_text("this is not a model, just some text that is long enough\n" * 3)
    _error(text, "not a GGUF file")
