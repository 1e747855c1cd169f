"""GGUF files as models: read, checked, named for Hugging Face, with their own tokenizer.

    model = read_gguf("SmolLM2-135M-Instruct.Q8_0.gguf")
    model.hf_config            # the config.json dict (architectures, hidden_size, ...)
    model.tensors["model.layers.0.self_attn.q_proj.weight"].data()   # raw Q8_0 blocks
    model.tokenizer_dir(cache)  # a folder with tokenizer.json and the chat template

We read the format ourselves (`reader.py`, ~250 lines of struct over an mmap) rather than with
the `gguf` package's GGUFReader: the format is small and stable, and our reader needs only the
standard library for the metadata (numpy only when a tensor is viewed), while `gguf` is an extra
dependency (an optional one here: the `demo` and `test` extras) that imports numpy, yaml and
requests (~90 ms) and builds a numpy record for every metadata field. Tests check our reader
against files written by the `gguf` package's GGUFWriter and values it dequantizes.

Nothing here dequantizes: quantized tensors are views of the file's bytes for the quantized
kernels to read in place.
"""

from __future__ import annotations

from asyncengine.gguf.errors import GGUFError
from asyncengine.gguf.ggml_types import SUPPORTED_TYPES, GGMLType
from asyncengine.gguf.hf_config import SUPPORTED_ARCHITECTURES, hf_config
from asyncengine.gguf.model import GGUFModel, GGUFTensor, read_gguf
from asyncengine.gguf.reader import GGUFFile, parse_gguf
from asyncengine.gguf.tensor_names import hf_row_order, hf_tensor_name
from asyncengine.gguf.tokenizer import tokenizer_dir

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TYPES",
    "GGMLType",
    "GGUFError",
    "GGUFFile",
    "GGUFModel",
    "GGUFTensor",
    "hf_config",
    "hf_row_order",
    "hf_tensor_name",
    "parse_gguf",
    "read_gguf",
    "tokenizer_dir",
]
