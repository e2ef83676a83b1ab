"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the log-probability of each prompt token given its prefix,
from the hidden states of the rows of a prompt chunk, in slices of rows."""

from __future__ import annotations

import torch

from deepserve.worker.launched_step import TokenLogprobs
from deepserve.worker.scheduler_output import ScheduledSequence

# Prompt-logprob logits are computed this many rows at a time (bounds the largest buffer of a step).
PROMPT_LOGPROB_ROWS = 512


def prompt_logprob_rows(s: ScheduledSequence) -> list[int]:
    """Offsets of this chunk's rows whose logits score the next prompt token."""
    seq = s.seq
    if seq.params.prompt_logprobs is None:
        return []
    end = min(s.start + s.num_new_tokens, seq.num_prompt_tokens - 1)
    return list(range(0, max(end - s.start, 0)))


def prompt_logprobs(model, s: ScheduledSequence, hidden: torch.Tensor) -> list[TokenLogprobs]:
    """Log-probability of each next prompt token given its prefix (raw model distribution), from the hidden states
    of the chunk's rows (those of `prompt_logprob_rows`). Logits are computed PROMPT_LOGPROB_ROWS rows at a time: a
    whole chunk's [rows, vocab] (0.75 MB a row for a Llama-3 vocabulary in bf16 + fp32) would be the largest buffer
    of a big step, and the start-up profile would have to reserve it out of the KV cache."""
    k = s.seq.params.prompt_logprobs
    entries = []
    for first in range(0, hidden.shape[0], PROMPT_LOGPROB_ROWS):
        rows = hidden[first:first + PROMPT_LOGPROB_ROWS]
        logprobs = torch.log_softmax(model.compute_logits(rows).float(), dim=-1)
        start = s.start + 1 + first
        targets = torch.tensor(s.seq.token_ids[start:start + rows.shape[0]], device=rows.device)
        target_lp = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        for i, tok in enumerate(targets.tolist()):
            entries.append((tok, target_lp[i], top_ids[i].tolist() if k else [], top_vals[i].tolist() if k else []))
    return entries


__all__ = ["PROMPT_LOGPROB_ROWS", "prompt_logprob_rows", "prompt_logprobs"]
