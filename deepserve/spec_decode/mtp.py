"""Drafting with DeepSeek-V3's MTP layer, run by the model runner right after a step picked its tokens.

Every position the step computed whose next token is now known goes through the MTP layer (its keys must exist for
later rows): all rows of a prompt chunk, the row of a plain decode, rows 0..a of a decode that verified drafts and
accepted a of them (rows after the first rejection hold positions that are not the sequence's). Row q's input is the
target's final hidden state at q and the token at q + 1; the last row's logits draft the token at q + 2, which is the
position the next step's first row predicts. The draft is the MTP's argmax (a deterministic drafter: the verifier's
point-mass rule is exact for it), its confidence the MTP's probability of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve.layers.forward_batch import ForwardBatch
from deepserve.spec_decode.drafts import ModelDrafter
from deepserve.worker.scheduler_output import ScheduledSequence


@dataclass
class MTPDraft:
    token_id: int
    confidence: float
    position: int           # index in the sequence the draft is for (its length when the draft is used)


def mtp_rows(s: ScheduledSequence, sampled: int | None, emitted: list[int] | None) -> list[int] | None:
    """Next tokens of the step's rows of `s` that the MTP layer takes (a prefix of them); None: no row (the
    sequence's token is not known here)."""
    seq, start, n = s.seq, s.start, s.num_new_tokens
    if emitted is not None:
        return emitted                                    # rows 0..a: accepted drafts, then the target's token
    known = seq.token_ids[start + 1:start + n + (0 if s.samples else 1)]
    if s.samples:
        if sampled is None:
            return None
        return known + [sampled]
    return known


def mtp_batch(batch: ForwardBatch, scheduled: list[ScheduledSequence], row_starts: list[int],
              next_tokens: list[list[int] | None], device: torch.device) -> tuple[ForwardBatch, list[int], list[int]]:
    """A ForwardBatch over the kept rows (same positions and KV slots as the step's), the index of each kept
    sequence in `scheduled`, and the token ids of the rows, flat."""
    rows, seq_index, ids, q_lens, s_lens, last = [], [], [], [], [], []
    for i, (s, first, tokens) in enumerate(zip(scheduled, row_starts, next_tokens)):
        if not tokens:
            continue
        rows.extend(range(first, first + len(tokens)))
        ids.extend(tokens)
        seq_index.append(i)
        q_lens.append(len(tokens))
        s_lens.append(s.start + len(tokens))
        last.append(len(rows) - 1)
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    seqs = torch.tensor(seq_index, dtype=torch.int64, device=device)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(q_lens), 0, out=starts[1:])
    out = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=batch.positions.index_select(0, index), slot_mapping=batch.slot_mapping.index_select(0, index),
        block_tables=batch.block_tables.index_select(0, seqs), query_start_loc=starts.to(device),
        seq_lens=torch.tensor(s_lens, dtype=torch.int64, device=device), query_lens_cpu=q_lens, seq_lens_cpu=s_lens,
        logits_indices=torch.tensor(last, dtype=torch.int64, device=device), block_size=batch.block_size,
        data_lens_cpu=s_lens)
    return out, seq_index, rows


def drafts_from_logits(logits: torch.Tensor, scheduled: list[ScheduledSequence], seq_index: list[int],
                       next_tokens: list[list[int] | None]) -> dict[int, MTPDraft]:
    probs = torch.softmax(logits, dim=-1)
    conf, token = probs.max(dim=-1)
    out = {}
    for j, i in enumerate(seq_index):
        s = scheduled[i]
        if not s.samples:
            continue                    # a prompt chunk that is not the last: nothing to draft yet
        out[s.seq.seq_id] = MTPDraft(int(token[j]), float(conf[j]), s.start + len(next_tokens[i]) + 1)
    return out


class MTPDrafter(ModelDrafter):
    """Serves the draft the MTP layer made for each sequence in the step before (spec_decode/mtp.py); its confidence
    is the MTP's own probability of the token."""

    def tokens_and_confidences(self, draft) -> tuple[list[int], list[float]]:
        return [draft.token_id], [draft.confidence]


