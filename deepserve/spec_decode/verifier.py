"""Verification of draft tokens: DeepInfer's acceptance rule (deepinfer.md §6.3), row-wise on the target's logits.

A sequence verifying t drafts has t + 1 query rows: row 0 is its last known token, rows 1..t the drafts. Row j's
logits predict the token after row j, so row j < t *verifies* draft j and row t is a *fresh* row.

    P = the target's processed distribution of the row (temperature, top-k, top-p, min-p; normalised)
    Q = the distribution the draft was drawn from: the drafter's processed row when it sampled the draft (DSpark
        for a sampled request: `VerifyGroup.draft_probs`), else a point mass on it (prompt lookup, argmax drafts)
    accept draft d  iff  min(P(d) / Q(d), 1) > U_verify(seed, pos)
    on the first rejection the row's token is drawn from the residual r = max(P - Q * e^-5e-5, 0) (unnormalised;
    the inverse CDF scales by its sum); if every draft is accepted the fresh row draws from P.

Emitted tokens are the accepted drafts plus that one token, so every step emits at least one. The penalty 5e-5
keeps the residual non-empty; the emitted distribution A satisfies P - eps/(1+eps) <= A <= (1+eps) P,
eps = 1 - e^-5e-5: the output is the target's distribution, not the drafter's. Greedy rows degenerate to
"accept iff the draft is the target's argmax" and emit the argmax, exactly the tokens of decoding without drafts.

Randomness is counter based and batch independent (kernels/reference/counter_rng.py): row j of a sequence whose
next position is p uses position p + j * 10000019 for its verify, residual (case 1) and fresh (case 0) uniforms, so
a t = 0 step draws exactly what plain sampling draws, and a seeded request gives the same tokens twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from deepserve.kernels.reference.counter_rng import CASE_RESIDUAL, CASE_SAMPLE, sample_uniforms, verify_uniforms
from deepserve.kernels.reference.sampling import sample_from_probs, shaped_probs
from deepserve.layers.sampler import greedy_tokens
from deepserve.sampling_params import SamplingParams
from deepserve.structured import bitmask as bitmask_ops

ROW_POSITION_STRIDE = 10000019      # DeepInfer's: keeps the rows of one step apart from the next steps' positions
_RESIDUAL_SHRINK = math.exp(-5e-5)


@dataclass
class VerifyGroup:
    """One sequence's rows in the logits handed to `verify` (consecutive, row 0 first)."""
    params: SamplingParams
    seed: int
    next_position: int              # position of the token row 0 predicts (the sequence's length)
    draft_token_ids: list[int]
    bitmask: torch.Tensor | None = None     # structured outputs: int32 words, a row per row of the group
    draft_probs: torch.Tensor | None = None     # [drafts, V]: each draft's Q row (a sampling drafter); None: points


@dataclass
class VerifyResult:
    emitted: list[list[int]]        # per group: accepted drafts + one token from the target
    num_accepted: list[int]
    logprobs: list[list[tuple[int, float, list[int], list[float]]]] | None   # per group, per emitted token


def verify(logits: torch.Tensor, groups: list[VerifyGroup], max_num_logprobs: int | None = None) -> VerifyResult:
    """`logits` [sum(t + 1), V]: every group's rows, in order. Raw logprobs (the model's distribution, as the
    sampler reports them) of each emitted token are returned when `max_num_logprobs` is not None."""
    raw = logits.float()
    logits = _apply_grammars(raw, groups)
    rows = _RowLayout(groups)
    greedy_out = greedy_tokens(logits)
    accept = greedy_out.cpu().numpy() == rows.drafts     # greedy rule; sampled rows are overwritten below
    outputs = greedy_out
    sampled_rows = np.flatnonzero(~rows.greedy)
    if sampled_rows.size:
        index = torch.from_numpy(sampled_rows).to(logits.device)
        s_accept, s_tokens = _verify_sampled(logits.index_select(0, index), rows, sampled_rows)
        accept[sampled_rows] = s_accept
        outputs = outputs.clone()
        outputs.index_copy_(0, index, s_tokens)
    out_tokens = outputs.tolist()
    emitted, num_accepted = [], []
    for g, first in zip(groups, rows.first_row):
        t = len(g.draft_token_ids)
        a = 0
        while a < t and accept[first + a]:
            a += 1
        emitted.append(g.draft_token_ids[:a] + [out_tokens[first + a]])
        num_accepted.append(a)
    logprobs = None
    if max_num_logprobs is not None:
        logprobs = _emitted_logprobs(raw, rows.first_row, emitted, max_num_logprobs)
    return VerifyResult(emitted, num_accepted, logprobs)


def _apply_grammars(logits: torch.Tensor, groups: list[VerifyGroup]) -> torch.Tensor:
    """Disallowed tokens of constrained groups' rows at -inf (a draft the grammar refuses is then rejected: the
    target gives it probability 0); unconstrained rows untouched."""
    if all(g.bitmask is None for g in groups):
        return logits
    words, rows, first = [], [], 0
    for g in groups:
        n = len(g.draft_token_ids) + 1
        if g.bitmask is not None:
            words.append(g.bitmask[:n])
            rows.extend(range(first, first + n))
        else:
            words.append(bitmask_ops.allocate(n, logits.shape[-1]))
        first += n
    return bitmask_ops.apply_bitmask(logits, torch.cat(words), torch.tensor(rows, dtype=torch.int64))


class _RowLayout:
    """Per-row arrays of a batch of groups: the draft a row verifies (-1 for fresh rows), greedy or not, and the
    row's counter position."""

    def __init__(self, groups: list[VerifyGroup]) -> None:
        drafts, greedy, positions, seeds, group_of = [], [], [], [], []
        self.first_row = []
        self.q_rows: dict[int, torch.Tensor] = {}       # layout row -> the Q row of the draft it verifies
        for i, g in enumerate(groups):
            self.first_row.append(len(drafts))
            t = len(g.draft_token_ids)
            if g.draft_probs is not None:
                self.q_rows.update((len(drafts) + j, g.draft_probs[j]) for j in range(t))
            drafts.extend(g.draft_token_ids + [-1])
            greedy.extend([g.params.is_greedy] * (t + 1))
            positions.extend(g.next_position + j * ROW_POSITION_STRIDE for j in range(t + 1))
            seeds.extend([g.seed] * (t + 1))
            group_of.extend([i] * (t + 1))
        self.groups = groups
        self.drafts = np.asarray(drafts, dtype=np.int64)
        self.greedy = np.asarray(greedy, dtype=bool)
        self.positions = positions
        self.seeds = seeds
        self.group_of = group_of


def _verify_sampled(logits: torch.Tensor, rows: _RowLayout, picked: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """Acceptance of the sampled rows' drafts and each row's own token (residual draw for a verify row, a draw from
    P for a fresh row). `picked`: the layout rows these logits rows are."""
    device, vocab = logits.device, logits.shape[-1]
    params = [rows.groups[rows.group_of[r]].params for r in picked]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=torch.int64,
                         device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    probs = shaped_probs(logits, temperature, top_k, top_p, min_p)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    drafts = rows.drafts[picked]
    is_verify = drafts >= 0
    seeds = [rows.seeds[r] for r in picked]
    positions = [rows.positions[r] for r in picked]
    draft_index = torch.from_numpy(np.where(is_verify, drafts, 0)).to(device)
    p_draft = probs.gather(1, draft_index[:, None])[:, 0].double().cpu().numpy()
    # Q(d): 1 for a point-mass draft, the drawn-from row's value for a sampled one.
    with_q = [i for i, r in enumerate(picked) if int(r) in rows.q_rows]
    q_rows = torch.stack([rows.q_rows[int(picked[i])].to(device, torch.float32) for i in with_q]) if with_q else None
    q_draft = np.ones(len(picked))
    if with_q:
        sel = torch.tensor(with_q, device=device)
        q_draft[with_q] = q_rows.gather(1, draft_index.index_select(0, sel)[:, None])[:, 0].double().cpu().numpy()
    with np.errstate(divide="ignore"):
        ratio = np.where(q_draft > 0, p_draft / np.maximum(q_draft, 1e-300), 1.0)
    accept = is_verify & (np.minimum(ratio, 1.0) > verify_uniforms(seeds, positions))
    # Residual rows: max(P - Q e^-5e-5, 0): a point mass takes the draft's mass off, a sampled Q its whole row; fresh
    # rows draw from P itself.
    point_rows = [i for i in np.flatnonzero(is_verify).tolist() if int(picked[i]) not in rows.q_rows]
    residual = probs.clone()
    if point_rows:
        idx = torch.tensor(point_rows, device=device)
        d = draft_index.index_select(0, idx)
        residual[idx, d] = (probs[idx, d] - _RESIDUAL_SHRINK).clamp_(min=0.0)
    if with_q:
        residual[sel] = (probs[sel] - q_rows * _RESIDUAL_SHRINK).clamp_(min=0.0)
    cases = np.where(is_verify, CASE_RESIDUAL, CASE_SAMPLE)
    uniforms = np.empty(len(picked), dtype=np.float64)
    for case in (CASE_SAMPLE, CASE_RESIDUAL):
        sel = np.flatnonzero(cases == case)
        if sel.size:
            uniforms[sel] = sample_uniforms([seeds[i] for i in sel], [positions[i] for i in sel], case)
    tokens = sample_from_probs(residual, torch.from_numpy(uniforms).to(device))
    return accept, tokens


def _emitted_logprobs(logits: torch.Tensor, first_row: list[int], emitted: list[list[int]], k: int):
    raw = torch.log_softmax(logits, dim=-1)
    row_ids, token_ids = [], []
    for first, tokens in zip(first_row, emitted):
        row_ids.extend(range(first, first + len(tokens)))
        token_ids.extend(tokens)
    rows = raw.index_select(0, torch.tensor(row_ids, device=logits.device))
    values = rows.gather(1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0].tolist()
    top_vals, top_ids = (rows.topk(k, dim=-1) if k else (None, None))
    top_vals = top_vals.tolist() if k else None
    top_ids = top_ids.tolist() if k else None
    out, i = [], 0
    for tokens in emitted:
        entries = []
        for tok in tokens:
            entries.append((tok, values[i], top_ids[i] if k else [], top_vals[i] if k else []))
            i += 1
        out.append(entries)
    return out
