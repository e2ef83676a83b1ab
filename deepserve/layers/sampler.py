"""Sampler: logits of the rows that sample this step -> next tokens (+ logprobs).

Order of work (vLLM's, with min_p after top-k/top-p as in vLLM v0):
  raw logprobs (log_softmax of the model's logits) -> grammar bitmask (structured outputs: disallowed tokens to
  -inf, before everything else) -> min_tokens bans -> repetition penalty (prompt and output
  tokens) -> frequency / presence penalties (output token counts) -> greedy rows: argmax; other rows:
  / temperature, softmax, top-k, top-p, min_p, then an inverse CDF in float64 driven by a counter-based uniform.

Batch invariance: every step is row-wise, and a row whose parameters switch a step off goes through that step
unchanged bit for bit (penalty 1 / 0, keep-all masks), so a row's token does not depend on which other rows
share the batch or their order. The uniform is a pure function of (seed, position), not of a shared generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from deepserve.kernels.reference.counter_rng import CASE_SAMPLE, sample_uniforms
from deepserve.kernels.reference.sampling import sample_from_probs, shaped_probs
from deepserve.layers.kernel_dispatch import use_triton
from deepserve.sampling_params import SamplingParams
from deepserve.structured import bitmask as bitmask_ops


@dataclass
class SamplingRow:
    """What the engine knows about one row to sample."""
    params: SamplingParams
    seed: int                   # always set: the engine draws one for unseeded requests
    position: int               # position of the token being sampled (= current sequence length)
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: set[int]     # the tokenizer's EOS ids (not banned when params.ignore_eos)
    grammar: object | None = None   # structured outputs: a StructuredMatcher, which fills this row's bitmask

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


class SequenceSamplingRow(SamplingRow):
    """A SamplingRow that reads a live sequence: its token lists are sliced only if a penalty asks for them
    (copying every sequence's tokens every step would cost more than the sampling itself), and its seed and position
    are read only by a batch that samples (an all-greedy one never does). A row lives for one `SamplingMetadata.build`,
    while the sequence does not change."""

    def __init__(self, seq, eos_token_ids: set[int]) -> None:
        self.params, self.eos_token_ids, self._seq = seq.params, eos_token_ids, seq
        self.grammar = getattr(seq, "grammar", None)

    @property
    def seed(self) -> int:
        return self._seq.seed

    @property
    def position(self) -> int:
        return self._seq.num_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._seq.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._seq.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return self._seq.num_output_tokens + self._seq.num_inflight   # outputs before the one being sampled


@dataclass
class SamplingMetadata:
    """Per-row tensors for one batch, built once per step. Neutral values (temperature 1 for greedy rows,
    top_k = vocab size, top_p = 1, penalties 1 / 0) leave a row untouched by a step other rows need."""
    # Shaping tensors: None when every row is greedy.
    temperature: torch.Tensor | None        # [B] float32; 1.0 for greedy rows (their logits are never divided)
    is_greedy: torch.Tensor | None          # [B] bool
    top_k: torch.Tensor | None              # [B] int64, vocab_size when disabled
    top_p: torch.Tensor | None              # [B] float32
    min_p: torch.Tensor | None              # [B] float32
    uniforms: torch.Tensor | None           # [B] float64 in [0, 1)
    # Penalty tensors: None when no row has a penalty.
    presence_penalty: torch.Tensor | None   # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    repetition_penalty: torch.Tensor | None  # [B] float32
    all_greedy: bool
    all_random: bool
    any_penalty: bool
    any_top_k_p: bool
    any_min_p: bool
    max_num_logprobs: int | None            # None: no row asked for logprobs
    prompt_token_mask: torch.Tensor | None  # [B, V] bool, only when a repetition penalty is active
    output_token_counts: torch.Tensor | None  # [B, V] int64, only when any penalty is active
    min_tokens_ban: tuple[torch.Tensor, torch.Tensor] | None  # (row indices, token ids) to set to -inf
    # Structured outputs: None when no row has a grammar. `token_bitmask` [B, ceil(V/32)] int32 (bit set =
    # allowed, structured/bitmask.py); only the rows in `grammar_rows` [G] int64 are masked, the others are
    # left untouched bit for bit.
    token_bitmask: torch.Tensor | None = None
    grammar_rows: torch.Tensor | None = None

    @property
    def argmax_of_raw_logits(self) -> bool:
        """Every row's token is the argmax of its logits as the model computed them: greedy rows, nothing to ban,
        mask or penalise."""
        return self.all_greedy and self.grammar_rows is None and self.min_tokens_ban is None and not self.any_penalty

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> "SamplingMetadata":
        params = [r.params for r in rows]
        greedy = [p.is_greedy for p in params]
        penalised = [_has_penalty(p) for p in params]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy, any_penalty = all(greedy), any(penalised)
        # An all-greedy batch only takes an argmax: skip the per-row tensors it would never read
        # (each one is a host-to-device copy, which adds up at every step of a large batch).
        temperature, is_greedy, top_k, top_p, min_p, uniforms = (
            (None,) * 6 if all_greedy else _shaping_tensors(rows, greedy, vocab_size, device))
        presence, frequency, repetition = _penalty_tensors(params, device) if any_penalty else (None,) * 3
        return cls(
            temperature=temperature, is_greedy=is_greedy, top_k=top_k, top_p=top_p, min_p=min_p, uniforms=uniforms,
            presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
            all_greedy=all_greedy,
            all_random=not any(greedy),
            any_penalty=any_penalty,
            # (An all-greedy batch shapes nothing: no pass over its rows for these.)
            any_top_k_p=not all_greedy and any(not g and (0 < p.top_k < vocab_size or p.top_p < 1)
                                               for p, g in zip(params, greedy)),
            any_min_p=not all_greedy and any(not g and p.min_p > 0 for p, g in zip(params, greedy)),
            max_num_logprobs=max(requested) if requested else None,
            prompt_token_mask=_prompt_token_mask(rows, vocab_size, device) if any_penalty else None,
            output_token_counts=_output_token_counts(rows, penalised, vocab_size, device) if any_penalty else None,
            min_tokens_ban=_min_tokens_ban(rows, vocab_size, device),
            **_grammar_bitmask(rows, vocab_size),
        )


def _shaping_tensors(rows: list[SamplingRow], greedy: list[bool], vocab_size: int, device):
    """(temperature, is_greedy, top_k, top_p, min_p, uniforms) of a batch with at least one sampled row."""
    params = [r.params for r in rows]
    uniforms = sample_uniforms([r.seed for r in rows], [r.position for r in rows], CASE_SAMPLE)
    return (_floats([1.0 if g else p.temperature for p, g in zip(params, greedy)], device),
            torch.tensor(greedy, dtype=torch.bool, device=device),
            torch.tensor([_top_k(p, vocab_size) for p in params], dtype=torch.int64, device=device),
            _floats([p.top_p for p in params], device),
            _floats([p.min_p for p in params], device),
            torch.from_numpy(uniforms).to(device))


def _penalty_tensors(params: list[SamplingParams], device):
    """(presence, frequency, repetition) penalties of a batch with at least one penalised row."""
    return (_floats([p.presence_penalty for p in params], device),
            _floats([p.frequency_penalty for p in params], device),
            _floats([p.repetition_penalty for p in params], device))


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                     # [B] int64
    logprobs: torch.Tensor | None               # [B] float32: the sampled token's raw logprob
    top_logprob_ids: torch.Tensor | None        # [B, K] int64, K = max requested (rows slice their own k)
    top_logprobs: torch.Tensor | None           # [B, K] float32


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # Raw logprobs describe the model's own distribution, before any of the request's shaping (vLLM's default).
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if meta.max_num_logprobs is not None else None
        logits = self.process_logits(logits, meta)
        token_ids = self.choose_tokens(logits, meta)
        return _gather_logprobs(raw_logprobs, token_ids, meta.max_num_logprobs)

    def process_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Bans and penalties, as float32 logits. Never writes into the caller's tensor (it may be returned as is).
        A greedy batch with nothing to apply keeps the logits' own dtype: its argmax picks the same token from a
        CUDA graph's bf16 logits as from their float32 copy (each bf16 value is a float32 value), without it."""
        if meta.argmax_of_raw_logits:
            return logits
        logits = logits.float()
        if meta.grammar_rows is not None:
            logits = bitmask_ops.apply_bitmask(logits, meta.token_bitmask, meta.grammar_rows)
        if meta.min_tokens_ban is not None:
            logits = logits.index_put(meta.min_tokens_ban, torch.tensor(float("-inf"), device=logits.device))
        if meta.any_penalty:
            logits = apply_penalties(logits, meta)
        return logits

    def choose_tokens(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax (first index on ties), the others draw from their shaped distribution."""
        greedy = greedy_tokens(logits) if not meta.all_random else None
        if meta.all_greedy:
            return greedy
        top_k, top_p = (meta.top_k, meta.top_p) if meta.any_top_k_p else (None, None)
        probs = shaped_probs(logits, meta.temperature, top_k, top_p, meta.min_p if meta.any_min_p else None)
        sampled = sample_from_probs(probs, meta.uniforms)
        return sampled if greedy is None else torch.where(meta.is_greedy, greedy, sampled)


def greedy_tokens(logits: torch.Tensor, out: torch.Tensor | None = None,
                  host_out: torch.Tensor | None = None) -> torch.Tensor:
    """Row-wise argmax, the first index on ties (into `out`, [B] int64, when given: a CUDA graph's static buffer;
    also into `host_out`, [B] int64, when given: pinned host memory the Triton kernel writes itself).
    A Triton kernel for CUDA tensors (torch's one-block-per-row reduction takes ~28 us for one 128k-entry row on an
    H200), a C one for float32 CPU tensors (torch's CPU argmax does not vectorize: 2.6 ms for 64 x 49k logits, 10x
    a plain max)."""
    if use_triton(logits):
        from deepserve.kernels.argmax import argmax_rows
        return argmax_rows(logits, out=out, host_out=host_out)
    picked = None
    if logits.is_cpu:
        from deepserve.kernels.cpu.argmax import argmax_rows as c_argmax_rows
        picked = c_argmax_rows(logits)         # None: no C library, or not float32 rows
    if picked is None:
        picked = logits.argmax(dim=-1)
    if host_out is not None:
        host_out.copy_(picked)
    return picked if out is None else out.copy_(picked)


# --- logits processing (the shaping and the inverse CDF are kernels/reference/sampling.py) ------------
def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty on prompt or output tokens (positive logits divided, negative multiplied), then
    frequency (x count) and presence (x seen) penalties on output tokens. Neutral rows come out unchanged."""
    counts = meta.output_token_counts
    seen_in_output = counts > 0
    seen = seen_in_output if meta.prompt_token_mask is None else seen_in_output | meta.prompt_token_mask
    rep = torch.where(seen, meta.repetition_penalty[:, None], 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - meta.frequency_penalty[:, None] * counts.float()
    return logits - meta.presence_penalty[:, None] * seen_in_output.float()


def _gather_logprobs(raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor,
                     max_num_logprobs: int | None) -> SamplerOutput:
    if raw_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    sampled = raw_logprobs.gather(-1, token_ids[:, None])[:, 0]
    if not max_num_logprobs:
        return SamplerOutput(token_ids, sampled, None, None)
    top_values, top_ids = raw_logprobs.topk(max_num_logprobs, dim=-1)
    return SamplerOutput(token_ids, sampled, top_ids, top_values)


# --- building metadata ------------------------------------------------------------------------
def _floats(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _top_k(params: SamplingParams, vocab_size: int) -> int:
    return params.top_k if 0 < params.top_k < vocab_size else vocab_size


def _has_penalty(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _token_bins(token_lists: list[list[int]], vocab_size: int,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for every token of every row; ids outside the vocabulary go to an extra
    column vocab_size, which the caller's [B, V + 1] tensor absorbs and then drops."""
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor([len(t) for t in token_lists]))
    ids = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64)
    ids = torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)
    return rows.to(device), ids.to(device)


def _prompt_token_mask(rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    # Only the repetition penalty looks at the prompt; rows without one contribute nothing.
    if all(r.params.repetition_penalty == 1.0 for r in rows):
        return None
    lists = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else [] for r in rows]
    mask = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
    mask[_token_bins(lists, vocab_size, device)] = True
    return mask[:, :vocab_size]


def _output_token_counts(rows: list[SamplingRow], penalised: list[bool], vocab_size: int,
                         device: torch.device | str) -> torch.Tensor | None:
    if not any(penalised):
        return None
    lists = [r.output_token_ids if p else [] for r, p in zip(rows, penalised)]
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.int64, device=device)
    index = _token_bins(lists, vocab_size, device)
    counts.index_put_(index, torch.ones_like(index[1]), accumulate=True)
    return counts[:, :vocab_size]


def _grammar_bitmask(rows: list[SamplingRow], vocab_size: int) -> dict[str, torch.Tensor | None]:
    """The token bitmask of a batch, filled on the host by each constrained row's matcher (the matcher has seen
    every emitted token: the engine waits for in-flight tokens of such rows). Moved to the device when applied."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return {"token_bitmask": None, "grammar_rows": None}
    bitmask = bitmask_ops.allocate(len(rows), vocab_size)
    for i in constrained:
        rows[i].grammar.fill_bitmask(bitmask, i)
    return {"token_bitmask": bitmask, "grammar_rows": torch.tensor(constrained, dtype=torch.int64)}


def _min_tokens_ban(rows: list[SamplingRow], vocab_size: int,
                    device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Until a row has min_tokens outputs, its EOS ids (unless ignore_eos) and stop_token_ids cannot be drawn."""
    ban_rows, ban_ids = [], []
    for i, r in enumerate(rows):
        if r.params.min_tokens == 0 or r.num_output_tokens >= r.params.min_tokens:
            continue
        banned = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_token_ids))
        banned = sorted(t for t in banned if 0 <= t < vocab_size)
        ban_rows += [i] * len(banned)
        ban_ids += banned
    if not ban_ids:
        return None
    return (torch.tensor(ban_rows, dtype=torch.int64, device=device),
            torch.tensor(ban_ids, dtype=torch.int64, device=device))
