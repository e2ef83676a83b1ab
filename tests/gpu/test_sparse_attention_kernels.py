"""DeepSeek-V4.1 attention kernels against their twins (deepserve/kernels/reference/sparse_attention.py): the sink
softmax over gathered slots (one or two sources, split over keys or not) and the indexer's logits."""

import math

import pytest
import torch

from deepserve.kernels import INTERPRET
from deepserve.kernels.reference import sparse_attention as twin
from deepserve.kernels.sparse_attention import (index_logits, index_logits_supported, sink_attention_gathered,
                                                sink_attention_supported, sink_config, sink_num_splits)
from kernel_testing import assert_close_rel, skip_bf16_in_interpreter
from test_fused_moe import _interpreter_scalars  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kernel (float32 statistics; probabilities rounded to the input dtype before P @ V) vs the float32 twin on the same
# inputs: relative Frobenius error and max abs error (|q|, |k| ~ 1, scores ~ N(0, 1)).
ATTN_TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (1.5e-2, 6e-2)}

# (rows, heads, head dim, window slots, selected slots): tiny shapes (a partial head tile, D not a power of two, K
# not a multiple of the key tile), then the real model's 64 heads x 512 with W = 128 and top-512 (few rows in the
# interpreter; decode batches of 1-256 rows on CUDA).
SHAPES = [(6, 4, 32, 8, 12), (5, 20, 64, 37, 70), (4, 3, 48, 16, 0), (5, 64, 512, 128, 512)]
REAL_ROWS = [2] if INTERPRET else [1, 7, 64, 256]


def _slots(rows, width, cache_rows, device, kind):
    """[rows, width] int64 slots into a cache of `cache_rows`: distinct per row, then -1 where `kind` says: "full"
    none, "tail" a -1 tail (a window before position W - 1, fewer entries than top-k), "scattered" half at random."""
    slots = torch.zeros(rows, width, dtype=torch.int64)
    for r in range(rows):
        slots[r] = torch.randperm(cache_rows)[:width]
    if kind == "tail":
        keep = torch.arange(width)[None, :] < torch.randint(0, width + 1, (rows, 1))
        slots = torch.where(keep, slots, -1)
    elif kind == "scattered":
        slots = torch.where(torch.rand(rows, width) < 0.5, slots, -1)
    return slots.to(device)


def _case(device, dtype, rows, heads, dim, w, k, kind="mixed"):
    """q, sources, sink of one step. "mixed": row 0 all keys, row 1 none at all, row 2 a single key (in the middle
    of the window), row 3 -1 tails, the rest scattered -1s; K of the second source not a multiple of the tile."""
    s0, s1 = max(2 * w, 64), max(2 * k, 64)
    q = torch.randn(rows, heads, dim, device=device).to(dtype)
    caches = [torch.randn(s0, dim, device=device).to(dtype), torch.randn(s1, dim, device=device).to(dtype)]
    if kind == "mixed":
        slots = [_slots(rows, w, s0, device, "scattered"), _slots(rows, k, s1, device, "scattered")]
        full = [_slots(1, w, s0, device, "full"), _slots(1, k, s1, device, "full")]
        tail = [_slots(1, w, s0, device, "tail"), _slots(1, k, s1, device, "tail")]
        for i in range(2):
            slots[i][0] = full[i][0]
            slots[i][1] = -1
            slots[i][2] = -1
            if rows > 3:
                slots[i][3] = tail[i][0]
        if w:
            slots[0][2, w // 2] = 3
    else:
        slots = [_slots(rows, w, s0, device, kind), _slots(rows, k, s1, device, kind)]
    sources = [(caches[0], slots[0])] + ([(caches[1], slots[1])] if k else [])
    sink = 2 * torch.randn(heads, device=device)
    return q, sources, sink


def _check(q, sources, sink, scale, dtype, **kwargs):
    assert sink_attention_supported(q, sources, sink)
    out = sink_attention_gathered(q, sources, sink, scale, **kwargs)
    ref = twin.sink_attention_gathered(q, sources, sink, scale)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert_close_rel(out, ref, ATTN_TOL[dtype])
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-D{}-W{}-K{}".format(*s))
def test_sink_attention_matches_twin(device, dtype, shape):
    """Both sources (or the window alone), rows with all, none, one and some of their keys, every split count."""
    skip_bf16_in_interpreter(dtype)
    rows, heads, dim, w, k = shape
    q, sources, sink = _case(device, dtype, rows, heads, dim, w, k)
    for splits in (None, 1, 2, 5):
        out, _ = _check(q, sources, sink, 1 / math.sqrt(dim), dtype, num_splits=splits)
        # A row with no key: the sink takes all the mass, the output is exactly zero.
        assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", REAL_ROWS)
def test_sink_attention_real_width(device, dtype, rows):
    """64 heads x 512, W = 128 window slots + 512 selected entries, from batch-1 decode (split over the keys) to a
    256-row batch (one program per row and head tile); early rows with -1 tails."""
    skip_bf16_in_interpreter(dtype)
    q, sources, sink = _case(device, dtype, rows, 64, 512, 128, 512, kind="tail")
    _check(q, sources, sink, 1 / math.sqrt(512), dtype)
    for block_h, block_n, warps in ((64, 64, 8), (32, 64, 4)):      # the tilings of larger batches, at any rows
        if dtype == torch.float32:
            break                                                      # float32 keeps 16 x 32 (shared memory)
        _check(q, sources, sink, 1 / math.sqrt(512), dtype, block_h=block_h, block_n=block_n, num_warps=warps)


def test_single_key_row(device):
    """A row whose only key is one slot: p = e^s / (e^s + e^sink), out = p k, against the closed form too."""
    dim, heads = 32, 4
    q, sources, sink = _case(device, torch.float32, 3, heads, dim, 16, 24)
    out, _ = _check(q, sources, sink, 0.25, torch.float32)
    key = sources[0][0][3]
    s = 0.25 * (q[2].float() @ key.float())                      # [heads]
    p = torch.exp(s) / (torch.exp(s) + torch.exp(sink))
    torch.testing.assert_close(out[2], p[:, None] * key.float()[None, :], rtol=1e-5, atol=1e-6)


def test_sink_dominates(device):
    """A sink far above every score leaves almost nothing to the keys; far below, the twin's plain softmax."""
    q, sources, _ = _case(device, torch.float32, 4, 8, 32, 16, 20, kind="full")
    for sink_value in (40.0, -40.0):
        sink = torch.full((8,), sink_value, device=device)
        out, _ = _check(q, sources, sink, 0.2, torch.float32, num_splits=3)
        if sink_value > 0:
            assert out.abs().max() < 1e-9


@pytest.mark.parametrize("kind", ["full", "scattered", "tail"])
def test_slot_patterns_and_layouts(device, kind):
    """int32 slots as strided views, q as a view of a wider projection (head stride > D), caches as row views of
    a wider buffer: the kernel reads them in place."""
    rows, heads, dim = 7, 16, 64
    q_full = torch.randn(rows, heads, dim + 8, device=device)
    q = q_full[..., :dim]
    wide = [torch.randn(96, dim + 16, device=device), torch.randn(80, dim + 16, device=device)]
    caches = [c[:, :dim] for c in wide]
    s0 = _slots(rows, 2 * 20, 96, device, kind).to(torch.int32)[:, ::2]        # column stride 2
    s1 = _slots(rows, 33, 80, device, kind).t().contiguous().t()                # column-major
    sink = torch.randn(heads, device=device)
    _check(q, [(caches[0], s0), (caches[1], s1)], sink, 1 / 8, torch.float32, num_splits=None)
    _check(q, [(caches[0], s0), (caches[1], s1)], sink, 1 / 8, torch.float32, num_splits=4)


def test_tiles_and_splits():
    """D = 512: all 64 heads a program for many rows, 32 from 32 rows, 16 below (H200 sweep); up to 64 heads at
    small D, never past the heads there are; splits only when the rows fill less than half the GPU, at least two key
    tiles each."""
    assert sink_config(64, 512, 256) == (64, 64, 8) and sink_config(64, 512, 64) == (32, 64, 4)
    assert sink_config(64, 512, 1) == (16, 32, 4) and sink_config(20, 512, 200) == (32, 64, 8)
    assert sink_config(64, 512, 256, torch.float32) == (16, 32, 4)
    assert sink_config(64, 64, 1) == (64, 64, 4) and sink_config(4, 32, 1) == (16, 64, 4)
    cpu = torch.device("cpu")                        # num_sms: 8 off CUDA
    assert sink_num_splits(256, 4, 20, cpu) == 1 and sink_num_splits(1, 8, 20, cpu) == 1
    assert sink_num_splits(1, 4, 20, cpu) == 2 and sink_num_splits(1, 1, 20, cpu) == 8
    assert sink_num_splits(1, 4, 3, cpu) == 1


def test_unsupported_falls_back_to_twin(device):
    """Cache dtype unlike q's, D past 512, three sources: the twin runs (same result as calling it)."""
    q, sources, sink = _case(device, torch.float32, 3, 4, 32, 8, 8)
    mixed = [(sources[0][0].half(), sources[0][1])]
    assert not sink_attention_supported(q, mixed, sink)
    torch.testing.assert_close(sink_attention_gathered(q, mixed, sink, 0.1),
                               twin.sink_attention_gathered(q, mixed, sink, 0.1))
    assert not sink_attention_supported(q, sources + sources[:1], sink)
    wide = torch.randn(2, 2, 1024, device=device)
    assert not sink_attention_supported(wide, [(torch.randn(4, 1024, device=device),
                                                torch.zeros(2, 1, dtype=torch.long, device=device))],
                                        torch.zeros(2, device=device))


def test_empty_rows(device):
    q, sources, sink = _case(device, torch.float32, 0, 4, 32, 8, 8, kind="full")
    assert sink_attention_gathered(q, sources, sink, 0.1).shape == (0, 4, 32)


# --- index logits ------------------------------------------------------------------------------------------------

# Exact products (float32 inputs: IEEE; half inputs: tensor-core products) summed in float32, against the float32
# twin: relative Frobenius error and max abs error, with |qi . ki| ~ 1.
INDEX_TOL = (2e-5, 2e-4)
# (rows, index heads, index head dim, keys): the real model's 32 x 128 at decode (one row) and prefill rows, then
# head counts and dims that are not powers of two and a single head; N not a multiple of the key tile.
INDEX_SHAPES = [(1, 32, 128, 1000), (5, 32, 128, 300), (3, 4, 64, 77), (7, 3, 40, 50), (2, 1, 16, 5)]


def _index_case(device, dtype, n, hi, di, N):
    qi = (torch.randn(n, hi, di, device=device) / di ** 0.25).to(dtype)
    ki = (torch.randn(N, di, device=device) / di ** 0.25).to(dtype)
    w = torch.randn(n, hi, device=device).to(dtype)
    return qi, w, ki


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", INDEX_SHAPES, ids=lambda s: "n{}-Hi{}-Di{}-N{}".format(*s))
def test_index_logits_matches_twin(device, dtype, shape):
    skip_bf16_in_interpreter(dtype)
    qi, w, ki = _index_case(device, dtype, *shape)
    assert index_logits_supported(qi, w, ki)
    out = index_logits(qi, w, ki)
    ref = twin.index_logits(qi, w, ki)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert_close_rel(out, ref, INDEX_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_logits_long_context(device, dtype):
    """Tens of thousands of entries (CUDA; a few thousand in the interpreter), decode and a prefill chunk."""
    skip_bf16_in_interpreter(dtype)
    N = 3000 if INTERPRET else 40000
    for n in (1, 3) if INTERPRET else (1, 64):
        qi, w, ki = _index_case(device, dtype, n, 32, 128, N)
        assert_close_rel(index_logits(qi, w, ki), twin.index_logits(qi, w, ki), INDEX_TOL)


def test_index_logits_strided_and_tiles(device):
    """qi as a view with a head stride past Di, ki rows of a wider buffer, w a column slice; forced tilings (key
    tiles per program not dividing the tiles there are)."""
    n, hi, di, N = 6, 8, 32, 130
    qi = torch.randn(n, hi, di + 4, device=device)[..., :di]
    ki = torch.randn(N, di + 8, device=device)[:, :di]
    w = torch.randn(n, 2 * hi, device=device)[:, ::2]
    ref = twin.index_logits(qi, w, ki)
    for block_t, block_n, per_program in ((None, None, None), (2, 16, 3), (8, 128, 1), (None, 16, 5)):
        out = index_logits(qi, w, ki, block_t=block_t, block_n=block_n, tiles_per_program=per_program)
        assert_close_rel(out, ref, INDEX_TOL)


def test_index_logits_empty_and_fallback(device):
    qi, w, ki = _index_case(device, torch.float32, 3, 4, 32, 0)
    assert index_logits(qi, w, ki).shape == (3, 0)
    qi, w, ki = _index_case(device, torch.float32, 2, 4, 32, 9)
    assert not index_logits_supported(qi, w, ki.half())                 # mixed dtypes: the twin
    torch.testing.assert_close(index_logits(qi, w, ki.half()), twin.index_logits(qi, w, ki.half()))
