"""A GGUF file's metadata and tensor table, parsed in one pass; the tensor data stays memory-mapped.

Why not `gguf.GGUFReader`: it turns every metadata item into numpy views of the memory map, one at a time, and the
default model's tokenizer arrays (49k tokens, 49k merges) took it 6.0 s of every process's startup on a 2-core CPU.
Here strings and numbers are decoded straight to Python values (0.39 s; benchmarks/gguf_startup.json); the tensors are the same views of the map
GGUFReader gives (`data`: typed values for F32/F16/... tensors, uint8 [..., row bytes] for quantized ones), and the
gguf package still does the type tables and the writing.

Layout (little-endian; GGUF v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 metadata count; each metadata
item a string key, a u32 value type and the value (an array: u32 item type, u64 count, the items); each tensor a
string name, u32 number of dims, u64 dims (fastest-varying first), u32 ggml type, u64 offset into the data section,
which starts at the next multiple of `general.alignment` (32 by default). A string is a u64 length and UTF-8 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {  # GGUFValueType -> (struct format, numpy dtype)
    gguf.GGUFValueType.UINT8: ("<B", np.uint8), gguf.GGUFValueType.INT8: ("<b", np.int8),
    gguf.GGUFValueType.UINT16: ("<H", np.uint16), gguf.GGUFValueType.INT16: ("<h", np.int16),
    gguf.GGUFValueType.UINT32: ("<I", np.uint32), gguf.GGUFValueType.INT32: ("<i", np.int32),
    gguf.GGUFValueType.FLOAT32: ("<f", np.float32), gguf.GGUFValueType.UINT64: ("<Q", np.uint64),
    gguf.GGUFValueType.INT64: ("<q", np.int64), gguf.GGUFValueType.FLOAT64: ("<d", np.float64),
    gguf.GGUFValueType.BOOL: ("<?", np.bool_),
}
_TYPED_TENSORS = {  # ggml types whose data is plain values, not blocks
    gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFTensor:
    """One tensor of the file: `shape` in ggml order (fastest-varying first), `data` a view of the memory map."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray = field(repr=False)


class GGUFFile:
    """`fields`: metadata key -> plain Python value (str, int, float, bool, or a list of them);
    `tensors`: the tensor table in file order. Raises ValueError on a file that is not GGUF v2/v3 little-endian
    or ends early."""

    def __init__(self, path: str):
        self.path = path
        self.map = np.memmap(path, mode="r")
        self._buf = memoryview(self.map)
        self._offset = 0
        if bytes(self._take(4)) != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
        version = self._scalar(gguf.GGUFValueType.UINT32)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are; a big-endian file "
                             "reads as a huge version)")
        tensor_count = self._scalar(gguf.GGUFValueType.UINT64)
        kv_count = self._scalar(gguf.GGUFValueType.UINT64)
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar(gguf.GGUFValueType.UINT32))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.fields.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
        self.data_offset = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{path}: duplicated tensor names")

    # --- reading -----------------------------------------------------------------------------------------------

    def _take(self, size: int) -> memoryview:
        start, self._offset = self._offset, self._offset + size
        if self._offset > len(self._buf):
            raise ValueError(f"{self.path}: the file ends inside its header (truncated?)")
        return self._buf[start:self._offset]

    def _scalar(self, value_type: int) -> Any:
        fmt, _ = _SCALARS[gguf.GGUFValueType(value_type)]
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return bytes(self._take(self._scalar(gguf.GGUFValueType.UINT64))).decode("utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type == gguf.GGUFValueType.STRING:
            return self._string()
        if value_type != gguf.GGUFValueType.ARRAY:
            return self._scalar(value_type)
        item_type = self._scalar(gguf.GGUFValueType.UINT32)
        count = self._scalar(gguf.GGUFValueType.UINT64)
        if item_type == gguf.GGUFValueType.STRING:
            return [self._string() for _ in range(count)]
        if item_type == gguf.GGUFValueType.ARRAY:
            return [self._value(gguf.GGUFValueType.ARRAY) for _ in range(count)]
        _, dtype = _SCALARS[gguf.GGUFValueType(item_type)]
        items = np.frombuffer(self._take(count * np.dtype(dtype).itemsize), dtype=np.dtype(dtype).newbyteorder("<"))
        return items.tolist()

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        dims = [self._scalar(gguf.GGUFValueType.UINT64) for _ in range(self._scalar(gguf.GGUFValueType.UINT32))]
        return name, dims, self._scalar(gguf.GGUFValueType.UINT32), self._scalar(gguf.GGUFValueType.UINT64)

    def _tensor(self, name: str, dims: list[int], raw_type: int, offset: int) -> GGUFTensor:
        ggml_type = gguf.GGMLQuantizationType(raw_type)
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elements * type_size // block_size
        start = self.data_offset + offset
        if start + n_bytes > len(self.map):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        np_dims = tuple(reversed(dims))
        if ggml_type in _TYPED_TENSORS:
            data = self.map[start:start + n_bytes].view(_TYPED_TENSORS[ggml_type]).reshape(np_dims)
        else:   # blocks: the last dimension in bytes
            data = self.map[start:start + n_bytes].reshape(*np_dims[:-1], np_dims[-1] // block_size * type_size)
        return GGUFTensor(name, ggml_type, np.array(dims, dtype=np.uint64), n_elements, n_bytes, start, data)


__all__ = ["GGUFFile", "GGUFTensor"]
