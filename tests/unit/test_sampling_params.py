"""SamplingParams: vLLM defaults, validation messages that name the field, normalisation."""

from __future__ import annotations

import pytest

from deepserve.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.logprobs, p.prompt_logprobs) == (False, None, None)
    assert (p.skip_special_tokens, p.include_stop_str_in_output) == (True, False)


@pytest.mark.parametrize("field, value, expected_range", [
    ("n", 0, ">= 1"),
    ("temperature", -0.1, ">= 0"),
    ("top_p", 0, "(0, 1]"),
    ("top_p", 1.01, "(0, 1]"),
    ("top_k", -2, "-1 (disabled) or >= 0"),
    ("min_p", -0.1, "[0, 1]"),
    ("min_p", 1.5, "[0, 1]"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("presence_penalty", -2.1, "[-2, 2]"),
    ("frequency_penalty", -3, "[-2, 2]"),
    ("repetition_penalty", 0, "> 0"),
    ("repetition_penalty", -1.0, "> 0"),
    ("max_tokens", 0, "None or >= 1"),
    ("min_tokens", -1, "[0, max_tokens=16]"),
    ("min_tokens", 17, "[0, max_tokens=16]"),
    ("logprobs", -1, "None or in [0, 20]"),
    ("logprobs", 21, "None or in [0, 20]"),
    ("prompt_logprobs", 21, "None or in [0, 20]"),
    ("stop_token_ids", [1, -1], ">= 0"),
])
def test_out_of_range_names_field_and_range(field, value, expected_range):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    offending = value[-1] if isinstance(value, list) else value
    assert message.startswith(field)
    assert expected_range in message
    assert message.endswith(f"got {offending!r}") or message.endswith(f"got {float(offending)!r}")


def test_top_p_message_example():
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 0"):
        SamplingParams(top_p=0)


@pytest.mark.parametrize("field, value", [
    ("temperature", "hot"), ("temperature", True), ("temperature", None), ("top_p", [0.5]),
    ("temperature", float("nan")), ("top_p", float("nan")), ("temperature", float("inf")),
    ("n", 1.0), ("n", True), ("top_k", "5"), ("top_k", False), ("seed", 1.5), ("seed", True),
    ("max_tokens", 3.0), ("min_tokens", None), ("logprobs", True), ("prompt_logprobs", "1"),
    ("ignore_eos", 1), ("skip_special_tokens", None), ("include_stop_str_in_output", "yes"),
    ("stop", 5), ("stop", [b"x"]), ("stop", ["ok", ""]), ("stop", ""),
    ("stop_token_ids", 5), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]),
])
def test_wrong_type_raises_value_error_naming_field(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        SamplingParams(**{field: value})


def test_min_tokens_unbounded_when_max_tokens_none():
    assert SamplingParams(max_tokens=None, min_tokens=10_000).min_tokens == 10_000


def test_ints_accepted_for_float_fields():
    p = SamplingParams(temperature=0, top_p=1, repetition_penalty=2)
    assert isinstance(p.temperature, float) and p.temperature == 0.0 and p.is_greedy


def test_stop_normalised_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []


def test_stop_token_ids_normalised_to_list():
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


@pytest.mark.parametrize("seed, masked", [
    (0, 0), (42, 42), (-1, 2**64 - 1), (2**64 - 1, 2**64 - 1), (2**64, 0), (2**64 + 5, 5), (-(2**63), 2**63),
])
def test_seed_masked_to_64_bits(seed, masked):
    assert SamplingParams(seed=seed).seed == masked


def test_sampling_type():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0, seed=3).sampling_type == SamplingType.GREEDY


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[1], seed=5)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1]


def test_normalisation_is_idempotent():
    import dataclasses
    p = SamplingParams(stop="x", seed=-1, top_k=-1)
    assert dataclasses.replace(p) == p
