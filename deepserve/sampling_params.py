"""SamplingParams: how to turn a request's logits into tokens (vLLM-compatible names and defaults)."""

from __future__ import annotations

import copy
import enum
import math
import numbers
from dataclasses import dataclass
from typing import Any

from deepserve.structured.spec import GrammarSpec, as_grammar_spec

# Temperatures below this are treated as greedy: dividing logits by them overflows or is pointless (vLLM's value).
_SAMPLING_EPS = 1e-5
_MAX_LOGPROBS = 20
_U64_MASK = (1 << 64) - 1


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs (deepserve/structured/spec.py): a dict such as {"json": schema} or {"regex": "..."};
    # after validation it holds the normalised GrammarSpec (also when given as DeepInfer's so_args).
    structured_outputs: dict[str, Any] | GrammarSpec | None = None
    so_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._check_types()
        self._check_ranges()
        self._normalise()

    # --- validation ---------------------------------------------------------------------------
    def _check_types(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            setattr(self, name, _as_float(name, getattr(self, name)))
        for name in ("n", "top_k", "min_tokens"):
            setattr(self, name, _as_int(name, getattr(self, name)))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            setattr(self, name, None if value is None else _as_int(name, value))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {_describe(getattr(self, name))}")
        self.stop = _as_stop_list(self.stop)
        self.stop_token_ids = _as_token_id_list(self.stop_token_ids)
        self.structured_outputs = as_grammar_spec(self.structured_outputs, self.so_args)

    def _check_ranges(self) -> None:
        _require(self.n >= 1, "n must be >= 1", self.n)
        _require(self.temperature >= 0, "temperature must be >= 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p must be in (0, 1]", self.top_p)
        _require(self.top_k == -1 or self.top_k >= 0, "top_k must be -1 (disabled) or >= 0", self.top_k)
        _require(0 <= self.min_p <= 1, "min_p must be in [0, 1]", self.min_p)
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]", self.presence_penalty)
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]", self.frequency_penalty)
        _require(self.repetition_penalty > 0, "repetition_penalty must be > 0", self.repetition_penalty)
        if self.max_tokens is not None:
            _require(self.max_tokens >= 1, "max_tokens must be None or >= 1", self.max_tokens)
            _require(0 <= self.min_tokens <= self.max_tokens,
                     f"min_tokens must be in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        else:
            _require(self.min_tokens >= 0, "min_tokens must be >= 0", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require(0 <= value <= _MAX_LOGPROBS, f"{name} must be None or in [0, {_MAX_LOGPROBS}]", value)

    def _normalise(self) -> None:
        # One spelling of "disabled" keeps the sampler's per-row tensors simple.
        if self.top_k == -1:
            self.top_k = 0
        # The RNG works on 64-bit words; masking here makes seed=-1 and seed=2**64-1 the same stream everywhere.
        if self.seed is not None:
            self.seed &= _U64_MASK

    # --- derived ------------------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)


def _describe(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def _require(ok: bool, message: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{message}, got {value!r}")


def _as_float(name: str, value: object) -> float:
    # bool is an int subclass; True as a temperature is almost surely a bug, so refuse it.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {_describe(value)}")
    return int(value)


def _as_stop_list(stop: object) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a str, a list of str or None, got {_describe(stop)}")
    for s in items:
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only str, got {_describe(s)}")
        if not s:
            raise ValueError("stop strings must be non-empty, got ''")
    return list(items)


def _as_token_id_list(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of int or None, got {_describe(ids)}")
    checked = [_as_int("stop_token_ids", t) for t in ids]
    for t in checked:
        _require(t >= 0, "stop_token_ids must be >= 0", t)
    return checked
