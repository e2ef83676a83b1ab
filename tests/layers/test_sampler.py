"""Sampler: greedy, seeded batch-invariant sampling, distribution shaping, penalties, bans, logprobs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepserve.layers.sampler as sampler_module
from deepserve.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow
from deepserve.sampling_params import SamplingParams


def make_row(params: SamplingParams | None = None, seed: int = 0, position: int = 0, prompt=(), output=(),
             eos=frozenset()) -> SamplingRow:
    return SamplingRow(params=params or SamplingParams(), seed=seed, position=position,
                       prompt_token_ids=list(prompt), output_token_ids=list(output), eos_token_ids=set(eos))


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    meta = SamplingMetadata.build(rows, logits.shape[-1], logits.device)
    return Sampler()(logits, meta)


def random_logits(batch: int, vocab: int, seed: int = 0, scale: float = 3.0, device: str = "cpu") -> torch.Tensor:
    return (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale).to(device)


# Every behaviour is checked on each available device: the sampler must not fall back to the host.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
on_each_device = pytest.mark.parametrize("device", DEVICES)


def empirical(logits_row: torch.Tensor, params: SamplingParams, draws: int = 20_000) -> torch.Tensor:
    """Frequencies of each token over `draws` seeds (one batch: every row is the same logits, its own seed)."""
    logits = logits_row.expand(draws, -1).contiguous()
    rows = [make_row(params, seed=s, position=5) for s in range(draws)]
    tokens = sample(logits, rows).token_ids
    return torch.bincount(tokens, minlength=logits.shape[-1]).double().cpu() / draws


# Four sigma of a frequency estimated from 20k draws is about 0.014.
FREQ_TOL = 0.015
SKEWED = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))  # softmax(SKEWED) = these probabilities


# --- greedy -------------------------------------------------------------------------------------
@on_each_device
def test_greedy_equals_argmax(device):
    logits = random_logits(8, 100, device=device)
    out = sample(logits, [make_row(SamplingParams(temperature=0.0), seed=i) for i in range(8)])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprobs is None


@on_each_device
def test_greedy_ties_take_lowest_index(device):
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]], device=device)
    assert sample(logits, [make_row(SamplingParams(temperature=0.0))]).token_ids.item() == 1


@on_each_device
def test_greedy_on_bf16_logits_matches_their_float32_copy(device):
    """A CUDA graph hands the sampler the LM head's bf16 logits: the greedy pick of them (no float32 copy made) is
    the pick of their float32 copy, ties included (bf16 has few values, so 50k logits of 4 rows hold many ties);
    a batch that samples or bans tokens still gets float32 logits to shape."""
    logits = random_logits(4, 50_000, seed=3, device=device).to(torch.bfloat16)
    greedy = [make_row(SamplingParams(temperature=0.0)) for _ in range(4)]
    meta = SamplingMetadata.build(greedy, logits.shape[-1], device)
    assert Sampler().process_logits(logits, meta) is logits
    assert torch.equal(sample(logits, greedy).token_ids, logits.float().argmax(-1))
    banned = [make_row(SamplingParams(temperature=0.0, min_tokens=1), eos={int(i)}) for i in logits.argmax(-1)]
    meta = SamplingMetadata.build(banned, logits.shape[-1], device)
    assert Sampler().process_logits(logits, meta).dtype == torch.float32
    assert not torch.equal(sample(logits, banned).token_ids, logits.float().argmax(-1))


def test_all_greedy_batch_without_logprobs_is_only_argmax(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("an all-greedy batch must not compute a sampling distribution")

    monkeypatch.setattr(sampler_module, "shaped_probs", must_not_run)
    monkeypatch.setattr(sampler_module, "apply_penalties", must_not_run)
    monkeypatch.setattr(torch, "log_softmax", must_not_run)
    logits = random_logits(4, 50)
    out = sample(logits, [make_row(SamplingParams(temperature=0.0)) for _ in range(4)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


@on_each_device
def test_top_k_one_is_greedy(device):
    logits = random_logits(64, 200, seed=1, device=device)
    rows = [make_row(SamplingParams(temperature=t, top_k=1), seed=i, position=i)
            for i, t in enumerate([0.3, 1.0, 2.5, 7.0] * 16)]
    assert torch.equal(sample(logits, rows).token_ids, logits.argmax(-1))


@on_each_device
def test_top_k_one_on_ties_takes_lowest_index_like_greedy(device):
    logits = torch.zeros(8, 5000, device=device)
    logits[:, 1234] = logits[:, 4000] = 1.0
    rows = [make_row(SamplingParams(top_k=1), seed=i) for i in range(7)] + [make_row(SamplingParams(temperature=0))]
    assert sample(logits, rows).token_ids.tolist() == [1234] * 8


@on_each_device
def test_tiny_top_p_keeps_only_argmax(device):
    logits = random_logits(64, 200, seed=2, device=device)
    rows = [make_row(SamplingParams(temperature=1.5, top_p=1e-6), seed=i) for i in range(64)]
    assert torch.equal(sample(logits, rows).token_ids, logits.argmax(-1))


@on_each_device
def test_bfloat16_logits(device):
    logits = random_logits(4, 64, seed=3, device=device).bfloat16()
    out = sample(logits, [make_row(SamplingParams(temperature=0.0, logprobs=2))] * 2
                 + [make_row(SamplingParams(seed=1), seed=1)] * 2)
    assert torch.equal(out.token_ids[:2], logits.float().argmax(-1)[:2])
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32


# --- seeded sampling is a function of (logits, params, seed, position) alone -----------------------
@st.composite
def sampling_rows(draw, vocab: int):
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 1.7])),
        top_k=draw(st.sampled_from([0, 1, 3, 20])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 0.05])),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.3])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.5, -0.5])),
        presence_penalty=draw(st.sampled_from([0.0, 1.0])),
        logprobs=draw(st.sampled_from([None, 0, 1, 5])),
        min_tokens=draw(st.sampled_from([0, 3])),
        stop_token_ids=draw(st.lists(st.integers(0, vocab - 1), max_size=2)),
    )
    tokens = st.lists(st.integers(0, vocab - 1), max_size=12)
    return make_row(params, seed=draw(st.integers(-(2**63), 2**64 - 1)), position=draw(st.integers(0, 10**6)),
                    prompt=draw(tokens), output=draw(tokens), eos={draw(st.integers(0, vocab - 1))})


def assert_same_row_result(batch: SamplerOutput, i: int, alone: SamplerOutput, k: int | None) -> None:
    assert batch.token_ids[i].item() == alone.token_ids[0].item()
    if k is None:
        return
    assert torch.equal(batch.logprobs[i], alone.logprobs[0])
    if k > 0:
        assert torch.equal(batch.top_logprob_ids[i, :k], alone.top_logprob_ids[0])
        assert torch.equal(batch.top_logprobs[i, :k], alone.top_logprobs[0])


VOCAB = 32


@on_each_device
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(sampling_rows(VOCAB), min_size=1, max_size=6), logits_seed=st.integers(0, 2**31),
       order_seed=st.integers(0, 2**31))
def test_row_result_independent_of_batch_and_order(device, rows, logits_seed, order_seed):
    logits = random_logits(len(rows), VOCAB, seed=logits_seed, device=device)
    batch = sample(logits, rows)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(order_seed)).to(device)
    shuffled = sample(logits[order], [rows[j] for j in order.tolist()])
    for i, row in enumerate(rows):
        alone = sample(logits[i:i + 1], [row])
        assert_same_row_result(batch, i, alone, row.params.logprobs)
        assert_same_row_result(shuffled, order.tolist().index(i), alone, row.params.logprobs)


def test_same_seed_and_position_same_token_different_position_varies():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(seed=7)
    first = [sample(logits, [make_row(params, seed=7, position=p)]).token_ids.item() for p in range(20)]
    again = [sample(logits, [make_row(params, seed=7, position=p)]).token_ids.item() for p in range(20)]
    assert first == again
    assert len(set(first)) > 10


# --- the distribution drawn from --------------------------------------------------------------
@on_each_device
@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.0])
def test_empirical_distribution_matches_softmax(device, temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    freq = empirical(logits.to(device), SamplingParams(temperature=temperature))
    expected = torch.softmax(logits.double() / temperature, -1)
    assert torch.allclose(freq, expected, atol=FREQ_TOL), (freq, expected)


def test_same_seed_across_positions_matches_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5])
    draws = 20_000
    rows = [make_row(SamplingParams(seed=99), seed=99, position=p) for p in range(draws)]
    tokens = sample(logits.expand(draws, -1).contiguous(), rows).token_ids
    freq = torch.bincount(tokens, minlength=4).double() / draws
    assert torch.allclose(freq, torch.softmax(logits.double(), -1), atol=FREQ_TOL)


def renormalised(probs: list[float], keep: list[int]) -> torch.Tensor:
    kept = torch.zeros(len(probs), dtype=torch.float64)
    kept[keep] = torch.tensor([probs[i] for i in keep], dtype=torch.float64)
    return kept / kept.sum()


@pytest.mark.parametrize("params, keep", [
    (SamplingParams(top_k=2), [0, 1]),
    (SamplingParams(top_k=3), [0, 1, 2]),
    (SamplingParams(top_p=0.75), [0, 1]),          # 0.5 < 0.75 <= 0.5 + 0.3
    (SamplingParams(top_p=0.85), [0, 1, 2]),       # 0.8 < 0.85 <= 0.95
    (SamplingParams(top_p=0.4), [0]),              # the top token alone already reaches 0.4
    (SamplingParams(top_k=2, top_p=0.6), [0]),      # top_p is relative to what top-k kept: 0.5 / 0.8 >= 0.6
    (SamplingParams(min_p=0.2), [0, 1, 2]),        # drop p < 0.1
    (SamplingParams(min_p=0.5), [0, 1]),           # drop p < 0.25
    (SamplingParams(min_p=1.0), [0]),
])
@on_each_device
def test_shaping_keeps_the_right_tokens_and_renormalises(device, params, keep):
    freq = empirical(SKEWED.to(device), params)
    expected = renormalised([0.5, 0.3, 0.15, 0.05], keep)
    assert set(torch.nonzero(freq).flatten().tolist()) == set(keep)
    assert torch.allclose(freq, expected, atol=FREQ_TOL), (freq, expected)


def test_top_k_larger_than_vocab_is_disabled():
    freq = empirical(SKEWED, SamplingParams(top_k=50))
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64), atol=FREQ_TOL)


def test_shaping_uses_temperature_scaled_probabilities():
    # At T=0.5 probabilities become 0.25:0.09:0.0225:0.0025 (normalised), so min_p=0.2 drops tokens 2 and 3.
    freq = empirical(SKEWED, SamplingParams(temperature=0.5, min_p=0.2))
    assert torch.allclose(freq, renormalised([0.25, 0.09, 0.0225, 0.0025], [0, 1]), atol=FREQ_TOL)


# --- penalties --------------------------------------------------------------------------------
def reference_penalised(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]):
    """The penalties written out token by token (vLLM's definitions)."""
    result = []
    for token, value in enumerate(logits):
        if token in prompt or token in output:
            r = params.repetition_penalty
            value = value / r if value > 0 else value * r
        count = output.count(token)
        value -= params.frequency_penalty * count
        value -= params.presence_penalty * (count > 0)
        result.append(value)
    return result


PENALTY_CASES = [
    (SamplingParams(repetition_penalty=1.5), [1, 2, 2], [3, 3, 5]),
    (SamplingParams(repetition_penalty=0.7), [0], [7]),
    (SamplingParams(frequency_penalty=0.8), [1, 2], [3, 3, 3, 4]),
    (SamplingParams(frequency_penalty=-1.2), [], [0, 0, 9]),
    (SamplingParams(presence_penalty=1.5), [1], [3, 3, 6]),
    (SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.6), [2, 4, 4], [4, 6, 6, 6]),
    (SamplingParams(), [1, 2], [3]),
]


@on_each_device
def test_penalties_match_per_row_reference(device):
    vocab = 10
    logits = random_logits(len(PENALTY_CASES), vocab, seed=5)
    rows = [make_row(p, prompt=prompt, output=output) for p, prompt, output in PENALTY_CASES]
    meta = SamplingMetadata.build(rows, vocab, device)
    processed = Sampler().process_logits(logits.to(device), meta).cpu()
    for i, (params, prompt, output) in enumerate(PENALTY_CASES):
        expected = torch.tensor(reference_penalised(logits[i].tolist(), params, prompt, output))
        assert torch.allclose(processed[i], expected, atol=1e-5), (i, processed[i], expected)
    assert torch.equal(processed[-1], logits[-1])       # no penalty: the row passes through unchanged


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    repeated = make_row(SamplingParams(temperature=0.0, presence_penalty=0.5), output=[0])
    assert sample(logits, [repeated]).token_ids.item() == 1
    assert sample(logits, [make_row(SamplingParams(temperature=0.0))]).token_ids.item() == 0


def test_process_logits_leaves_caller_logits_alone():
    logits = random_logits(1, 10, seed=6)
    before = logits.clone()
    row = make_row(SamplingParams(repetition_penalty=2.0, min_tokens=2), prompt=[1, 2], eos={3})
    Sampler().process_logits(logits, SamplingMetadata.build([row], 10, "cpu"))
    assert torch.equal(logits, before)


# --- min_tokens ----------------------------------------------------------------------------------
def min_tokens_logits() -> torch.Tensor:
    # EOS (5) and the stop token (7) are by far the most likely; token 2 is next.
    logits = torch.zeros(1, 10)
    logits[0, 5], logits[0, 7], logits[0, 2] = 10.0, 9.0, 5.0
    return logits


@on_each_device
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_bans_eos_and_stop_token_ids(device, temperature):
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[7])
    rows = [make_row(params, seed=s, output=[1, 1], eos={5}) for s in range(200)]
    tokens = set(sample(min_tokens_logits().expand(200, -1).to(device), rows).token_ids.tolist())
    assert not tokens & {5, 7}


def test_min_tokens_ignore_eos_keeps_eos_allowed_but_bans_stop_ids():
    logits = min_tokens_logits()
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5, 7], ignore_eos=True)
    assert sample(logits, [make_row(params, output=[1], eos={5})]).token_ids.item() == 2  # 5 is a stop id here
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    assert sample(logits, [make_row(params, output=[1], eos={5})]).token_ids.item() == 5


def test_min_tokens_lifted_once_reached():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    assert sample(min_tokens_logits(), [make_row(params, output=[1], eos={5})]).token_ids.item() == 2
    assert sample(min_tokens_logits(), [make_row(params, output=[1, 1], eos={5})]).token_ids.item() == 5


def test_min_tokens_ignores_ids_outside_vocab():
    params = SamplingParams(temperature=0.0, min_tokens=2)
    assert sample(min_tokens_logits(), [make_row(params, eos={5, 10_000})]).token_ids.item() == 7


# --- logprobs --------------------------------------------------------------------------------------
@on_each_device
def test_logprobs_are_raw_log_softmax_with_top_ids(device):
    vocab = 50
    logits = random_logits(4, vocab, seed=8, device=device)
    rows = [
        make_row(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5), prompt=[1, 2], output=[3]),
        make_row(SamplingParams(temperature=0.7, top_k=5, logprobs=5), seed=11, position=3),
        make_row(SamplingParams(temperature=1.3, min_p=0.1, logprobs=0, min_tokens=5), seed=12, eos={0}),
        make_row(SamplingParams(seed=4), seed=4),
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits.float(), -1)
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    assert out.top_logprob_ids.shape == (4, 5) and out.top_logprobs.shape == (4, 5)
    expected_ids = torch.argsort(raw, dim=-1, descending=True)[:, :5]
    assert torch.equal(out.top_logprob_ids, expected_ids)
    assert torch.equal(out.top_logprobs, raw.gather(1, expected_ids))


def test_logprobs_zero_gives_only_sampled_logprob():
    logits = random_logits(2, 20, seed=9)
    out = sample(logits, [make_row(SamplingParams(logprobs=0, seed=1), seed=1), make_row()])
    assert out.logprobs.shape == (2,)
    assert out.top_logprob_ids is None and out.top_logprobs is None


# --- CUDA --------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_and_logprobs_match_cpu():
    logits = random_logits(16, 1000, seed=10)
    rows = [make_row(SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=50, top_p=0.9, min_p=0.01,
                                    repetition_penalty=1.2, logprobs=2, min_tokens=2),
                     seed=i, position=i, prompt=[1, 2, 3], output=[4], eos={0}) for i in range(16)]
    on_gpu = sample(logits.cuda(), rows)
    on_cpu = sample(logits, rows)
    assert torch.equal(on_gpu.token_ids.cpu()[1::2], on_cpu.token_ids[1::2])
    assert torch.allclose(on_gpu.top_logprobs.cpu(), on_cpu.top_logprobs, atol=1e-5)
