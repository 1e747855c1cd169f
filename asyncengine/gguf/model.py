"""`read_gguf(path) -> GGUFModel`: a checked GGUF file as a config, HF-named tensors and a
tokenizer folder, with every tensor a zero-copy view of the file's mapping."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncengine.gguf.errors import GGUFError
from asyncengine.gguf.ggml_types import BLOCK_LAYOUT, GGMLType
from asyncengine.gguf.hf_config import gguf_architecture, hf_config
from asyncengine.gguf.reader import GGUFFile, TensorInfo, parse_gguf
from asyncengine.gguf.tensor_names import (
    NON_PARAMETER_TENSORS,
    expected_hf_names,
    hf_row_order,
    hf_tensor_name,
    permuted_heads,
)
from asyncengine.gguf.tokenizer import check_tokenizer, tokenizer_dir

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the file, as stored: its ggml type, its shape and its raw bytes.

    `shape` is outermost first (numpy / torch order, the reverse of GGUF's `ne`): a linear
    weight is `(out_features, in_features)` like its HF counterpart. Quantized tensors stay
    blocks of bytes: row r is `row_nbytes` bytes, `in_features // block_size` whole blocks.
    `permuted_heads` is set on llama files' q/k weights and biases, whose rows llama.cpp
    interleaved per head (see `tensor_names`): `hf_rows()` gathers them back into HF order.
    """

    name: str  # the GGUF name
    hf_name: str | None
    ggml_type: GGMLType
    shape: tuple[int, ...]
    offset: int  # in the file
    nbytes: int
    permuted_heads: int | None
    _file: GGUFFile = field(repr=False, compare=False)

    @property
    def block_size(self) -> int:
        return BLOCK_LAYOUT[self.ggml_type][0]

    @property
    def row_nbytes(self) -> int:
        block_size, block_nbytes = BLOCK_LAYOUT[self.ggml_type]
        return self.shape[-1] // block_size * block_nbytes

    @property
    def num_rows(self) -> int:
        rows = 1
        for dim in self.shape[:-1]:
            rows *= dim
        return rows

    def data(self) -> npt.NDArray[np.uint8]:
        """The tensor's bytes, a read-only zero-copy view of the file: `(num_rows, row_nbytes)`."""
        import numpy as np

        flat = np.frombuffer(
            self._file.buffer, dtype=np.uint8, count=self.nbytes, offset=self.offset
        )
        return flat.reshape(self.num_rows, self.row_nbytes)

    def memoryview(self) -> memoryview:
        """The tensor's bytes as a read-only memoryview of the file's mapping (for
        `torch.frombuffer`); while it lives, the mapping stays."""
        return memoryview(self._file.buffer)[self.offset : self.offset + self.nbytes]

    def release_pages(self) -> None:
        """Drop this process's resident pages of the tensor's bytes (the file keeps them: a
        later read maps them again), once it is read into a copy, so that the copy does not
        count twice in the resident set."""
        page = mmap.PAGESIZE
        start = (self.offset + page - 1) // page * page
        end = (self.offset + self.nbytes) // page * page
        if end > start:
            self._file.buffer.madvise(mmap.MADV_DONTNEED, start, end - start)

    def view(self) -> npt.NDArray[Any]:
        """A zero-copy array of the values of an F32 / F16 tensor (BF16: its uint16 bit
        patterns, for torch's `.view(torch.bfloat16)`), of `shape`; quantized: `data()`."""
        import numpy as np

        dtypes = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: np.uint16}
        if self.ggml_type not in dtypes:
            return self.data()
        return self.data().view(dtypes[self.ggml_type]).reshape(self.shape)

    def hf_row_order(self) -> list[int] | None:
        """The gather index putting this tensor's rows in HF order, or None if they are."""
        if self.permuted_heads is None:
            return None
        return hf_row_order(self.shape[0], self.permuted_heads)

    def hf_rows(self) -> npt.NDArray[Any]:
        """`data()` with rows in HF order: the view itself where no permutation applies, else
        a copy with whole rows (whole quantized blocks) moved, nothing dequantized. For a 1-D
        tensor (a q/k bias) the values, `view()`, permuted the same way."""
        order = self.hf_row_order()
        if len(self.shape) == 1:
            return self.view() if order is None else self.view()[order]
        return self.data() if order is None else self.data()[order]


@dataclass(slots=True)
class GGUFModel:
    """A servable GGUF file: what the engine needs to run it, without a Hugging Face folder.

    - `hf_config`: the config.json dict (see `hf_config`);
    - `tensors`: HF parameter name → `GGUFTensor` (raw, still quantized views of the file);
    - `extra_tensors`: GGUF tensors with no HF parameter (`rope_freqs.weight`);
    - `metadata`: every metadata key/value of the file;
    - `tokenizer_dir(cache)`: a tokenizer folder built from the file's metadata.
    """

    path: Path
    architecture: str  # general.architecture
    metadata: dict[str, Any]
    hf_config: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    extra_tensors: dict[str, GGUFTensor]
    file: GGUFFile = field(repr=False)

    @property
    def served_name(self) -> str:
        """The model name a server announces for this file: its stem."""
        return self.path.stem

    def tokenizer_dir(self, cache: str | os.PathLike[str]) -> Path:
        return tokenizer_dir(self.path, self.metadata, cache)

    def close(self) -> None:
        self.file.close()


def read_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Map and check a GGUF file; nothing is dequantized and no tensor byte is read.

    Raises `GGUFError` (a `ValueError` naming the file and the problem) for a file that is
    truncated, not GGUF or of another version, has corrupt tensor offsets, an architecture other
    than llama, mistral, qwen2 and qwen3, a tensor of a type asyncengine does not run, tensors
    missing or unknown for its architecture, or no tokenizer."""
    file = parse_gguf(path)
    try:
        return _checked_model(file)
    except BaseException:
        file.close()
        raise


def _checked_model(file: GGUFFile) -> GGUFModel:
    # 1. What the file is: an architecture we run, every tensor of a type we run, in bounds.
    arch = gguf_architecture(file.path, file.metadata)
    infos = file.check_tensors()
    # 2. The config, and the tensors it implies: each one named, none missing.
    config = hf_config(file.path, file.metadata, {n: t.ggml_type for n, t in infos.items()})
    tensors, extra = _named_tensors(file, arch, config, infos)
    _check_complete(file.path, arch, config, tensors)
    _add_bias_flags(arch, config, tensors)
    # 3. A tokenizer to serve it with.
    check_tokenizer(file.path, file.metadata)
    return GGUFModel(file.path, arch, file.metadata, config, tensors, extra, file)


def _named_tensors(
    file: GGUFFile, arch: str, config: dict[str, Any], infos: dict[str, TensorInfo]
) -> tuple[dict[str, GGUFTensor], dict[str, GGUFTensor]]:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, GGUFTensor] = {}
    extra: dict[str, GGUFTensor] = {}
    for info in infos.values():
        hf_name = hf_tensor_name(info.name)
        if hf_name is None and info.name not in NON_PARAMETER_TENSORS:
            raise GGUFError(
                file.path,
                f"tensor {info.name!r} has no counterpart in a {arch} model "
                "(mixture-of-experts and multimodal files are not supported)",
            )
        tensor = GGUFTensor(
            info.name, hf_name, info.ggml_type, info.shape, info.offset, info.nbytes,
            permuted_heads(arch, info.name, heads, kv_heads), file,
        )  # fmt: skip
        if hf_name is None:
            extra[info.name] = tensor
        else:
            tensors[hf_name] = tensor
    return tensors, extra


def _check_complete(
    path: Path, arch: str, config: dict[str, Any], tensors: dict[str, GGUFTensor]
) -> None:
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in tensors
    expected = expected_hf_names(
        arch, config["num_hidden_layers"], tied=config["tie_word_embeddings"], qkv_bias=qkv_bias
    )
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise GGUFError(
            path,
            f"{len(missing)} tensors of a {arch} model are missing (first: {missing[0]!r}); "
            "the file is incomplete or not a plain decoder",
        )
    unexpected = sorted(set(tensors) - set(expected) - _optional_biases(tensors))
    if unexpected:
        raise GGUFError(
            path,
            f"tensor {tensors[unexpected[0]].name!r} does not belong in a {arch} model with "
            f"{config['num_hidden_layers']} layers",
        )


def _optional_biases(tensors: dict[str, GGUFTensor]) -> set[str]:
    """Biases a llama/qwen3 checkpoint may carry (attention_bias / mlp_bias)."""
    return {n for n in tensors if n.endswith(".bias") and ".layers." in n}


def _add_bias_flags(arch: str, config: dict[str, Any], tensors: dict[str, GGUFTensor]) -> None:
    """attention_bias / mlp_bias, as a llama or qwen3 config.json with biases states them."""
    if arch == "qwen2":
        return  # Qwen2's q/k/v biases are part of the architecture
    if "model.layers.0.self_attn.q_proj.bias" in tensors:
        config["attention_bias"] = True
    if "model.layers.0.mlp.up_proj.bias" in tensors:
        config["mlp_bias"] = True
