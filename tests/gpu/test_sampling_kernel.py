"""The sampling kernel against the reference Sampler: the same tokens for the same uniforms.

Where a decision sits within rounding of a boundary (the float32 softmax sum and the float64 running sums are
added in another order than PyTorch's), the token is not well defined; a row counts as well defined when the
reference's own token is unchanged under (a) 3 random relative perturbations of 1e-6 of the logits (about 8 float32
ulps, over 10x the kernel's own deviation) and (b) relative nudges of 1e-7 to the uniform. Every well-defined row
must match exactly, and at least 90% of rows must be well defined (in practice almost all are)."""

import pytest
import torch

from deepserve.kernels import INTERPRET
from deepserve.kernels.sampling import SAMPLE_CONFIG, choose_tokens, counter_uniforms, sample_tokens, sample_tokens_ref
from deepserve.kernels.reference.counter_rng import CASE_RESIDUAL, CASE_SAMPLE, torch_sample_uniforms
from deepserve.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from deepserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", [CASE_SAMPLE, CASE_RESIDUAL])
def test_counter_uniforms_bit_identical(device, case):
    n = 4099
    seeds = torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), dtype=torch.int64)
    positions = torch.randint(0, 2 ** 40, (n,), dtype=torch.int64)
    positions[:5] = torch.tensor([0, 1, 2, 2 ** 31, 2 ** 32 + 7])
    ref = torch_sample_uniforms(seeds, positions, case)
    out = counter_uniforms(seeds.to(device), positions.to(device), case).cpu()
    assert out.dtype == torch.float64
    assert torch.equal(out, ref)


def _params_grid(vocab):
    grid = []
    for temp in (0.0, 0.6, 1.0, 1.7):
        for top_k in (0, 1, 5, 50, 1000):
            for top_p in (1.0, 0.9, 0.5):
                for min_p in (0.0, 0.05):
                    if temp == 0.0 and (top_k or top_p < 1 or min_p):
                        continue
                    grid.append(SamplingParams(temperature=temp, top_k=min(top_k, vocab), top_p=top_p, min_p=min_p))
    return grid


def _meta(params, vocab, device, seed0=0):
    rows = [SamplingRow(params=p, seed=seed0 + 7919 * i, position=100 + i, prompt_token_ids=[], output_token_ids=[],
                        eos_token_ids=set()) for i, p in enumerate(params)]
    return SamplingMetadata.build(rows, vocab, device)


def _well_defined(logits, meta, base):
    """Rows whose reference token survives perturbations much larger than the kernel's rounding differences."""
    sampler = Sampler()
    stable = torch.ones_like(base, dtype=torch.bool)
    gen = torch.Generator(device=logits.device).manual_seed(1)
    for _ in range(3):
        noise = torch.randn(logits.shape, generator=gen, device=logits.device) * 1e-6
        stable &= sampler.choose_tokens(logits * (1 + noise), meta) == base
    uniforms = meta.uniforms
    for f in (1 - 1e-7, 1 + 1e-7):
        meta.uniforms = (uniforms * f).clamp(max=1 - 2 ** -53)
        stable &= sampler.choose_tokens(logits, meta) == base
    meta.uniforms = uniforms
    return stable


VOCABS = [1000, 32000, 151936] if not INTERPRET else [300, 2000]
# The default launch configuration and two others (smaller blocks; counts by compare-and-sum, not tl.histogram).
CONFIGS = {"default": SAMPLE_CONFIG, "small": {"block": 512, "rblock": 512, "hist": False, "num_warps": 8},
           "mixed": {"block": 1024, "rblock": 256, "hist": True, "num_warps": 4},
           "mid": {"block": 2048, "rblock": 512, "hist": True, "num_warps": 8}}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_sampling_matches_sampler(device, vocab, scale, config):
    params = _params_grid(vocab)
    if INTERPRET:
        params = params[::6]
    logits = torch.randn(len(params), vocab, device=device) * scale
    logits[0, 3] = float("-inf")   # a banned token
    meta = _meta(params, vocab, device)
    base = Sampler().choose_tokens(logits, meta)
    out = choose_tokens(logits, meta, config=CONFIGS[config])
    assert out.dtype == torch.int64 and out.shape == base.shape
    defined = _well_defined(logits, meta, base)
    assert defined.float().mean() >= 0.9, f"only {defined.float().mean():.2f} of rows well defined"
    bad = (out != base) & defined
    bad_rows = bad.nonzero().flatten().tolist()
    assert not bad.any(), f"rows {bad_rows} differ: kernel {out[bad].tolist()} reference {base[bad].tolist()} " \
                          f"params {[params[i] for i in bad_rows]}"
    # The kept sets must really be enforced: greedy rows are argmax; top_k = 1 rows are argmax too.
    for i, p in enumerate(params):
        if p.temperature == 0.0 or p.top_k == 1:
            assert out[i] == logits[i].argmax()


def test_sampling_counter_rng_in_kernel(device):
    """Uniforms made in the kernel from (seed, position) give the reference's tokens for those uniforms."""
    vocab, b = (32000, 64) if not INTERPRET else (500, 8)
    logits = torch.randn(b, vocab, device=device) * 3
    seeds = torch.randint(-2 ** 63, 2 ** 63 - 1, (b,), dtype=torch.int64).to(device)
    positions = torch.randint(0, 10 ** 6, (b,), dtype=torch.int64).to(device)
    temp = torch.full((b,), 0.8, device=device)
    greedy = torch.zeros(b, dtype=torch.bool, device=device)
    top_k = torch.randint(1, vocab, (b,), device=device)
    top_p = torch.rand(b, device=device) * 0.5 + 0.5
    min_p = torch.zeros(b, device=device)
    for case in (CASE_SAMPLE, CASE_RESIDUAL):
        out = sample_tokens(logits, temp, greedy, top_k, top_p, min_p, seeds=seeds, positions=positions, case=case)
        uniforms = torch_sample_uniforms(seeds.cpu(), positions.cpu(), case).to(device)
        via_u = sample_tokens(logits, temp, greedy, top_k, top_p, min_p, uniforms=uniforms)
        assert torch.equal(out, via_u)
        ref = sample_tokens_ref(logits, temp, greedy, top_k, top_p, min_p, uniforms=uniforms)
        assert (out == ref).float().mean() >= 0.95


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("top_k", [1, 3, 17, 200, 0])
def test_ties_break_by_index(device, top_k, config):
    """Logits on a coarse grid (many exact ties at the top-k and top-p thresholds): the kernel keeps the same tied
    tokens as the reference's stable sort."""
    vocab, b = (5000, 48) if not INTERPRET else (400, 6)
    logits = torch.randint(-8, 3, (b, vocab), device=device).float() * 0.5
    params = [SamplingParams(temperature=t, top_k=top_k, top_p=p) for t in (0.7, 1.0, 1.5) for p in (1.0, 0.6)]
    params = (params * b)[:b]
    meta = _meta(params, vocab, device, seed0=5)
    base = Sampler().choose_tokens(logits, meta)
    out = choose_tokens(logits, meta, config=CONFIGS[config])
    uniforms = meta.uniforms
    stable = torch.ones_like(base, dtype=torch.bool)
    for f in (1 - 1e-7, 1 + 1e-7):
        meta.uniforms = (uniforms * f).clamp(max=1 - 2 ** -53)
        stable &= Sampler().choose_tokens(logits, meta) == base
    assert stable.float().mean() >= 0.9
    assert torch.equal(out[stable], base[stable])


@pytest.mark.parametrize("top_k,top_p,expected", [(4, 1.0, {3, 9, 10, 30}), (64, 0.5, {3, 9, 10, 30}),
                                                  (5, 0.5, {3, 9, 10})])
def test_tie_set_exact(device, top_k, top_p, expected):
    """The tie rule directly: 6 tokens tie for the top (probability ~0.165 each). top_k = 4 keeps the 4 lowest
    indices; top_p = 0.5 keeps ties while the mass before them is < 0.5 of the total (3 x 0.165 = 0.496 < 0.5);
    after top_k = 5 the limit is 0.5 x 5 x 0.165 = 0.41, so only 3 survive."""
    vocab = 64
    logits = torch.full((200, vocab), -5.0, device=device)
    tied = torch.tensor([3, 9, 10, 30, 40, 63], device=device)
    logits[:, tied] = 2.0
    b = logits.shape[0]
    ones = torch.ones(b, device=device)
    seeds = torch.arange(b, dtype=torch.int64, device=device)
    positions = torch.zeros(b, dtype=torch.int64, device=device)
    for config in CONFIGS.values():
        out = sample_tokens(logits, ones, torch.zeros(b, dtype=torch.bool, device=device),
                            torch.full((b,), top_k, device=device), ones * top_p, torch.zeros(b, device=device),
                            seeds=seeds, positions=positions, config=config)
        assert set(out.tolist()) == expected
    ref = sample_tokens_ref(logits, ones, torch.zeros(b, dtype=torch.bool, device=device),
                            torch.full((b,), top_k, device=device), ones * top_p, torch.zeros(b, device=device),
                            seeds=seeds, positions=positions)
    assert set(ref.tolist()) == expected
