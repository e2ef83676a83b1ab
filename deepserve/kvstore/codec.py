"""One stored block: its per-layer KV tensors as bytes, with a checksum over all of them.

    header  "DSKV" | version u16 | reserved u16 | body length u64 | blake2b-16 of the body
    body    meta length u32 | meta (JSON: the entry's name, each tensor's dtype and shape) | raw tensor bytes

`decode` refuses (CorruptEntry) anything that is not exactly what `encode` wrote for that name: a wrong magic
or version, a truncated or padded body, a checksum mismatch, another entry's name (a misplaced file), sizes
that do not add up. A refused entry is recomputed by the engine, never used.
"""

from __future__ import annotations

import hashlib
import json
import struct
import warnings

import torch

MAGIC = b"DSKV"
VERSION = 1
_HEADER = struct.Struct("<4sHHQ16s")
HEADER_SIZE = _HEADER.size
_META_LEN = struct.Struct("<I")


class CorruptEntry(ValueError):
    """A stored entry that is not a whole, intact encoding of the block asked for."""


def _checksum(body: bytes | memoryview) -> bytes:
    return hashlib.blake2b(body, digest_size=16).digest()


def encode(name: str, tensors: list[torch.Tensor]) -> bytes:
    """The entry bytes of one block: `tensors` are its per-layer caches, on the host."""
    raw = [t.detach().contiguous().view(torch.uint8).reshape(-1).numpy() for t in tensors]
    meta = json.dumps({"name": name, "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)]
                                                 for t in tensors]}).encode()
    body = b"".join([_META_LEN.pack(len(meta)), meta, *(r.tobytes() for r in raw)])
    return _HEADER.pack(MAGIC, VERSION, 0, len(body), _checksum(body)) + body


def decode(name: str, data: bytes | bytearray | memoryview) -> list[torch.Tensor]:
    """The block's per-layer tensors (views of `data`); CorruptEntry if `data` is not `name`'s intact entry."""
    view = memoryview(data)
    if len(view) < HEADER_SIZE:
        raise CorruptEntry(f"{name}: {len(view)} bytes, shorter than the header")
    magic, version, _, body_len, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise CorruptEntry(f"{name}: not a version-{VERSION} KV entry")
    body = view[HEADER_SIZE:]
    if len(body) != body_len:
        raise CorruptEntry(f"{name}: body of {len(body)} bytes, the header says {body_len} (truncated?)")
    if _checksum(body) != checksum:
        raise CorruptEntry(f"{name}: checksum mismatch")
    (meta_len,) = _META_LEN.unpack_from(body)
    try:
        meta = json.loads(bytes(body[_META_LEN.size:_META_LEN.size + meta_len]))
    except ValueError:
        raise CorruptEntry(f"{name}: unreadable metadata") from None
    if meta.get("name") != name:
        raise CorruptEntry(f"{name}: holds entry {meta.get('name')!r}")
    return _tensors(name, body, _META_LEN.size + meta_len, meta["tensors"])


def _tensors(name: str, body: memoryview, offset: int, specs: list) -> list[torch.Tensor]:
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # a read-only buffer: the tensors are only read (copied into the cache)
        for dtype_name, shape in specs:
            dtype = getattr(torch, dtype_name)
            count = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            if offset + count > len(body):
                raise CorruptEntry(f"{name}: tensor data past the end of the entry")
            flat = torch.frombuffer(body, dtype=torch.uint8, count=count, offset=offset) if count else \
                torch.empty(0, dtype=torch.uint8)
            out.append(flat.view(dtype).reshape(shape))
            offset += count
    if offset != len(body):
        raise CorruptEntry(f"{name}: {len(body) - offset} bytes past the last tensor")
    return out
