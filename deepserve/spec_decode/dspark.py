"""Drafting with DeepSeek-V4.1's DSpark draft blocks (deepinfer.md §2.10), run by the model runner right after a
step picked its tokens; the drafts wait in `DSparkDrafter` for the next step (as the MTP drafter's, mtp.py).

Every target forward writes the main-cache keys of each of its rows into the draft layers' SWA states
(models/deepseek_v41.py). After the step, a sequence that now knows its next token g (a decode, or the last chunk
of its prompt) has length n with positions 0..p = n - 2 committed; its block [g, noise, ..., noise] at positions
p+1 .. p+N goes through the draft blocks (each row: the main keys at [p-W+1, p] of its layer, the block's own keys,
bidirectional, and the sink), and N drafts follow one by one through the Markov head:

    logits_i = norm(hb_i) @ head^T + markov_head(markov_embed[prev_i])      prev_0 = g, prev_i = d_i
    conf_i   = sigmoid(clamp(w_c · [hb_i ; markov_embed[prev_i]] / T, -60, 60))
    d_{i+1}  = argmax (greedy) | a draw from the request's shaped distribution (temperature, top-k, top-p, min-p)
               with the counter RNG at seed + 1000000007, position n + i (the position the draft is for; §6.3's
               "(seqlen_k - q + 1) + last_valid_offset + (i + 1)")

Drafts i..N after a draft that is a stop token (EOS unless ignore_eos, or a stop_token_ids id) get confidence 0.

Readings: drafts are made right after a prompt's last chunk too (§2.10 makes none at prefill and sends padding
drafts with the first decode; we know g then, so the first decode verifies real drafts). The block's own keys live
only for the call (the positions they stand at are the next step's target rows, which write the real keys): the
same visible set as DeepInfer's ring. T is the request's temperature, 1e-5 for greedy requests (§6.3's greedy
temperature: their confidences are close to 0 or 1). A sampled request's drafts keep the distribution each was
drawn from (`DSparkDraft.probs`, normalised), which the verifier uses as §6.3's Q: accept with min(P/Q, 1), residual
max(P - Q e^-5e-5, 0). Greedy drafts are argmaxes: point masses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve.kernels.reference.counter_rng import CASE_SAMPLE, sample_uniforms
from deepserve.kernels.reference.sampling import sample_from_probs, shaped_probs
from deepserve.layers.forward_batch import ForwardBatch
from deepserve.layers.paged_state import RowSlots
from deepserve.sequence import Sequence
from deepserve.spec_decode.drafts import ModelDrafter, ScheduledRows

MTP_SEED_OFFSET = 1000000007        # §6.3: the draft ("mtp") random stream
GREEDY_TEMPERATURE = 1e-5           # §6.3: greedy rows' temperature (the confidence head divides by it)


@dataclass
class DSparkDraft:
    token_ids: list[int]
    confidences: list[float]
    position: int           # the sequence's length when the drafts are used (draft 0 is for that position)
    probs: torch.Tensor | None = None   # [drafts, V] the distributions sampled drafts were drawn from (§6.3's Q)


@dataclass
class _Block:
    """One sequence's draft block: its row in the step's batch, g, its length n after the step, the draft count."""
    index: int
    seq: Sequence
    g: int
    n: int
    count: int


def draft_blocks(scheduled: list[ScheduledRows], sampled: dict[int, int], emitted: dict[int, list[int]],
                 num_drafts: int, max_position: int, table_rows: list[int] | None = None) -> list[_Block]:
    """The sequences of the step that know their next token now, with what their blocks need. `table_rows`: the
    row of each scheduled sequence's block table in the step's batch (default: row i for sequence i; a decode
    replayed from a CUDA graph has a row per position, each holding its sequence's table)."""
    blocks = []
    for i, s in enumerate(scheduled):
        seq_id = s.seq.seq_id
        if seq_id in emitted:                        # verified: accepted drafts + one token, g the last
            tokens = emitted[seq_id]
            n = s.start + 1 + len(tokens)
            g = tokens[-1]
        elif s.samples and seq_id in sampled:
            n = s.start + s.num_new_tokens + 1
            g = sampled[seq_id]
        else:
            continue                                 # a prompt chunk that is not the last
        count = min(num_drafts, max_position - (n - 1))   # block rows at positions n-1 .. n+count-2
        if count > 0:
            blocks.append(_Block(i if table_rows is None else table_rows[i], s.seq, g, n, count))
    return blocks


@torch.inference_mode()
def run_dspark(model, batch: ForwardBatch, blocks: list[_Block], eos_token_ids: set[int],
               window: int) -> dict[int, DSparkDraft]:
    """Every block through the draft layers at once (rows flat, sequence by sequence), then the drafts position by
    position. `batch`: the step's forward batch (its window tables hold the main keys of the W positions before
    each block, the ones the block reads)."""
    if not blocks:
        return {}
    device = batch.block_tables.device
    first = [0]
    for b in blocks:
        first.append(first[-1] + b.count)
    row_seq = torch.tensor([j for j, b in enumerate(blocks) for _ in range(b.count)], dtype=torch.long)
    offset = torch.tensor([i for b in blocks for i in range(b.count)], dtype=torch.long)
    n = torch.tensor([b.n for b in blocks], dtype=torch.long)
    positions = n[row_seq] - 1 + offset                                  # p + 1 + i
    ids = torch.tensor([b.g if i == 0 else model.spec.dspark_noise_token_id for b in blocks for i in range(b.count)],
                       dtype=torch.long)
    # Main keys [p-W+1, p] of each row's sequence (the same set for every row of a block).
    p = (n - 2)[row_seq]
    main_pos = p[:, None] - torch.arange(window)[None, :]
    table_rows = torch.tensor([b.index for b in blocks], dtype=torch.long, device=device)
    tables = batch.window_tables.index_select(0, table_rows)
    slots = RowSlots(tables, row_seq.to(device), batch.block_size, tables)
    main_slots = torch.where(main_pos.to(device) >= 0, slots.token_slots(main_pos.to(device)), -1)
    # The block's own keys: rows first[j] .. first[j] + count - 1 of this call, -1 padded.
    width = max(b.count for b in blocks)
    k = torch.arange(width)[None, :]
    counts = torch.tensor([b.count for b in blocks])[row_seq]
    starts = torch.tensor(first[:-1])[row_seq]
    block_slots = torch.where(k < counts[:, None], starts[:, None] + k, -1).to(device)
    hb = model.draft_hidden(ids.to(device), positions.to(device), main_slots, block_slots)
    base = model.draft_base_logits(hb)
    return _draw(model, hb, base, blocks, first, eos_token_ids)


def _draw(model, hb: torch.Tensor, base: torch.Tensor, blocks: list[_Block], first: list[int],
          eos_token_ids: set[int]) -> dict[int, DSparkDraft]:
    device, V = hb.device, base.shape[-1]
    prev = [b.g for b in blocks]
    tokens: list[list[int]] = [[] for _ in blocks]
    confs: list[list[float]] = [[] for _ in blocks]
    q_rows: list[list[torch.Tensor]] = [[] for _ in blocks]     # sampled requests: each draft's Q row
    stops = [set() if b.seq.params.ignore_eos else set(eos_token_ids) for b in blocks]
    for j, b in enumerate(blocks):
        stops[j].update(b.seq.params.stop_token_ids or ())
    for i in range(max(b.count for b in blocks)):
        live = [j for j, b in enumerate(blocks) if b.count > i]
        rows = torch.tensor([first[j] + i for j in live], dtype=torch.long, device=device)
        logits, conf_logit = model.draft_step(hb.index_select(0, rows), base.index_select(0, rows),
                                              torch.tensor([prev[j] for j in live], dtype=torch.long, device=device))
        params = [blocks[j].seq.params for j in live]
        temp = torch.tensor([GREEDY_TEMPERATURE if q.is_greedy else q.temperature for q in params],
                            dtype=torch.float32, device=device)
        conf = torch.sigmoid((conf_logit / temp).clamp(-60, 60)).tolist()
        drawn = logits.argmax(dim=-1)
        sampled = [r for r, q in enumerate(params) if not q.is_greedy]
        if sampled:
            sel = torch.tensor(sampled, dtype=torch.long, device=device)
            ps = [params[r] for r in sampled]
            probs = shaped_probs(logits.index_select(0, sel), temp.index_select(0, sel),
                                 torch.tensor([q.top_k if 0 < q.top_k < V else V for q in ps], device=device),
                                 torch.tensor([q.top_p for q in ps], dtype=torch.float32, device=device),
                                 torch.tensor([q.min_p for q in ps], dtype=torch.float32, device=device))
            u = sample_uniforms([blocks[live[r]].seq.seed + MTP_SEED_OFFSET for r in sampled],
                                [blocks[live[r]].n + i for r in sampled], CASE_SAMPLE)
            drawn = drawn.clone()
            drawn.index_copy_(0, sel, sample_from_probs(probs, torch.from_numpy(u).to(device)))
            q = probs / probs.sum(dim=-1, keepdim=True)
            for r, row in zip(sampled, q):
                q_rows[live[r]].append(row)
        for r, (j, d) in enumerate(zip(live, drawn.tolist())):
            stopped = any(t in stops[j] for t in tokens[j])
            tokens[j].append(d)
            confs[j].append(0.0 if stopped else conf[r])
            prev[j] = d
    return {b.seq.seq_id: DSparkDraft(tokens[j], confs[j], b.n, torch.stack(q_rows[j]) if q_rows[j] else None)
            for j, b in enumerate(blocks)}


class DSparkDrafter(ModelDrafter):
    """Serves the drafts the DSpark blocks made for each sequence in the step before, with their confidences."""

    def tokens_and_confidences(self, draft) -> tuple[list[int], list[float]]:
        return draft.token_ids, draft.confidences

    def distributions(self, draft):
        return draft.probs


