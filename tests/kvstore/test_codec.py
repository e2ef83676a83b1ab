"""codec: a block's tensors round-trip exactly; anything but the intact entry of that name is refused."""

from __future__ import annotations

import pytest
import torch

from deepserve.kvstore.codec import HEADER_SIZE, CorruptEntry, decode, encode


def block(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 16, 2, 8, generator=g).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_round_trip_is_exact(dtype):
    tensors = block(dtype)
    out = decode("fp-h", encode("fp-h", tensors))
    assert len(out) == 3
    for a, b in zip(tensors, out):       # compared as bytes (fp8 caches: kv_cache_dtype "fp8" / "fp8_e5m2")
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)


def test_non_contiguous_views_are_stored_by_value():
    cache = torch.randn(2, 5, 16, 2, 8)
    view = cache.select(1, 3)                    # how the runner takes one block out of a layer's cache
    assert not view.is_contiguous()
    assert torch.equal(decode("n", encode("n", [view]))[0], view)


def corruptions(data: bytes):
    body = HEADER_SIZE + 40
    flipped = bytearray(data)
    flipped[body] ^= 0x01
    yield "flipped byte", bytes(flipped)
    yield "truncated", data[:-1]
    yield "truncated header", data[:HEADER_SIZE - 2]
    yield "padded", data + b"\0"
    yield "empty", b""
    yield "wrong magic", b"XXXX" + data[4:]


@pytest.mark.parametrize("case", range(6))
def test_every_corruption_is_refused(case):
    data = encode("fp-h", block())
    _what, bad = list(corruptions(data))[case]
    with pytest.raises(CorruptEntry):
        decode("fp-h", bad)


def test_another_entrys_bytes_are_refused():
    data = encode("fp-a", block())
    with pytest.raises(CorruptEntry, match="holds entry"):
        decode("fp-b", data)
