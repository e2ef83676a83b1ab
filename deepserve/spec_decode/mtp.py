"""Drafting with DeepSeek-V3's MTP layer, run by the model runner right after a step picked its tokens.

The first draft. Every position the step computed whose next token is now known goes through the MTP layer (its keys
must exist for later rows): all rows of a prompt chunk, the row of a plain decode, rows 0..a of a decode that verified
drafts and accepted a of them (rows after the first rejection hold positions that are not the sequence's). Row q's
input is the target's final hidden state at q and the token at q + 1; the last row's logits draft the token at q + 2,
which is the position the next step's first row predicts.

Drafts 2..k (num_speculative_tokens > 1). V3 checkpoints hold one MTP layer, so it is applied again, one position
further each time (what vLLM and SGLang do for V3): draft i + 1 comes from a "chain row" at position p0 + i whose
inputs are the MTP's own hidden state for draft i (the target's does not exist there yet) and draft i's token; p0 is
the sequence's last row above (its new length minus 2). A chain row is a decode row: it attends to the sequence's MTP
keys up to p0 and to the chain rows before it.

Where the chain rows' keys go. Position p0 + i is at or past the sequence's computed length, so whatever the chain
writes there is overwritten, before any row reads it, by the step that computes that position for real (it runs the
MTP layer over it with the real token). So the key may go wherever only this sequence's chain reads it. But the
scheduler reserves slots for the step's own rows only (the drafts verified in it included; rewinding frees the
rejected ones' blocks after the step: a sequence holds exactly its computed tokens' blocks), and a chain row can be up
to k - 1 positions past the sequence's last block. Chain rows inside the sequence's blocks write there: those blocks
are private from the step's first position on (copy-on-write saw to that) and hold no prefix-cache block (only
computed positions are named). Chain rows past them write into scratch blocks at the end of the MTP layer's cache,
ceil((k - 1) / block_size) for each drafting sequence of the step (`MTPScratch`), which the chain's block table maps
those logical blocks to. The block manager never hands scratch blocks out and only chain rows read them, so no draft
keeps a block or leaves KV anyone else reads. (Reserving k - 1 lookahead slots in the scheduler instead, vLLM's way,
would hold blocks for positions that may never be verified and count them in every preemption decision.)

Every draft is the MTP's argmax (a deterministic drafter: the verifier's point-mass rule is exact for it), its
confidence the MTP's probability of it (given the drafts before it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepserve.layers.forward_batch import ForwardBatch, upload_int64
from deepserve.spec_decode.drafts import ModelDrafter, ScheduledRows


@dataclass
class MTPDraft:
    token_ids: list[int]
    confidences: list[float]
    position: int           # the sequence's length when the drafts are used (draft 0 is for that position)


@dataclass
class MTPScratch:
    """Blocks [first_block, first_block + num_seqs * blocks_per_seq) of the MTP layer's cache, past the block
    manager's: the j-th drafting sequence of a step writes the chain rows past its own blocks into share j."""
    first_block: int
    blocks_per_seq: int
    num_seqs: int

    @staticmethod
    def blocks_per_sequence(num_drafts: int, block_size: int) -> int:
        """Chain rows sit at most num_drafts - 1 positions past the last block a sequence holds."""
        return -(-(num_drafts - 1) // block_size)

    def table(self, j: int, table: list[int], last_position: int, block_size: int) -> list[int]:
        """`table` extended with share j's blocks up to the block of `last_position`."""
        extra = last_position // block_size + 1 - len(table)
        if extra <= 0:
            return table
        if extra > self.blocks_per_seq or j >= self.num_seqs:
            raise RuntimeError(f"MTP chain row at position {last_position} is {extra} blocks past the sequence's "
                               f"{len(table)}; scratch holds {self.blocks_per_seq} for each of {self.num_seqs} sequences")
        first = self.first_block + j * self.blocks_per_seq
        return table + list(range(first, first + extra))


def mtp_rows(s: ScheduledRows, sampled: int | None, emitted: list[int] | None) -> list[int] | None:
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


def _forward_batch(input_ids, positions: list[int], q_lens: list[int], tables: list[list[int]], block_size: int,
                   device: torch.device) -> ForwardBatch:
    """Sequence b's rows at positions[first_b : first_b + q_lens[b]] (consecutive, ending its visible keys), KV slots
    from tables[b]; logits for each sequence's last row. `input_ids`: host list or a device tensor."""
    slots, s_lens, last, rows = [], [], [], 0
    for n, table in zip(q_lens, tables):
        slots.extend(table[p // block_size] * block_size + p % block_size for p in positions[rows:rows + n])
        rows += n
        s_lens.append(positions[rows - 1] + 1)
        last.append(rows - 1)
    width = max(len(t) for t in tables)
    flat = [b for t in tables for b in t + [0] * (width - len(t))]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    host_ids = [] if isinstance(input_ids, torch.Tensor) else input_ids
    ids, pos, slot, table, qsl, lens, idx = upload_int64([host_ids, positions, slots, flat, starts, s_lens, last], device)
    return ForwardBatch(
        input_ids=input_ids if isinstance(input_ids, torch.Tensor) else ids, positions=pos, slot_mapping=slot,
        block_tables=table.view(len(tables), width), query_start_loc=qsl, seq_lens=lens, query_lens_cpu=list(q_lens),
        seq_lens_cpu=s_lens, logits_indices=idx, block_size=block_size, data_lens_cpu=s_lens)


def mtp_batch(scheduled: list[ScheduledRows], next_tokens: list[list[int] | None], block_size: int,
              device: torch.device) -> tuple[ForwardBatch, list[int], list[int]]:
    """A ForwardBatch over the kept rows (the step's positions and KV slots), the index of each kept sequence in
    `scheduled`, and the row of the step's hidden states each kept row reads (a row per scheduled position, in
    order: the layout of the eager step's hidden states and of the decode graphs' hidden buffer alike)."""
    rows, seq_index, ids, positions, q_lens, tables = [], [], [], [], [], []
    first = 0
    for i, (s, tokens) in enumerate(zip(scheduled, next_tokens)):
        if tokens:
            rows.extend(range(first, first + len(tokens)))
            ids.extend(tokens)
            positions.extend(range(s.start, s.start + len(tokens)))
            seq_index.append(i)
            q_lens.append(len(tokens))
            tables.append(s.seq.block_table)
        first += s.num_new_tokens
    return _forward_batch(ids, positions, q_lens, tables, block_size, device), seq_index, rows


@dataclass
class _Chain:
    """One drafting sequence: its row in the latest MTP forward's outputs, its drafts' rows in every forward's
    outputs concatenated, how many drafts it makes and the block table its chain rows write through."""
    seq_id: int
    length: int             # the sequence's length after this step: drafts are for positions length ..
    depth: int
    row: int
    table: list[int]
    picks: list[int] = field(default_factory=list)


def _chains(scheduled: list[ScheduledRows], seq_index: list[int], next_tokens: list[list[int] | None],
            num_drafts: int, max_model_len: int, block_size: int, scratch: MTPScratch | None) -> list[_Chain]:
    chains = []
    for row, i in enumerate(seq_index):
        s = scheduled[i]
        if not s.samples:
            continue                    # a prompt chunk that is not the last: nothing to draft yet
        length = s.start + len(next_tokens[i]) + 1
        # Drafts past max_model_len are never verified; stopping there keeps chain positions inside the rotary table.
        depth = max(1, min(num_drafts, max_model_len - length))
        table = s.seq.block_table
        if depth > 1:
            table = scratch.table(len(chains), table, length - 2 + depth - 1, block_size)
        chains.append(_Chain(s.seq.seq_id, length, depth, row, table, [row]))
    return chains


@torch.inference_mode()
def run_mtp(model, build_metadata, scheduled: list[ScheduledRows], next_tokens: list[list[int] | None],
            hidden: torch.Tensor, num_drafts: int, max_model_len: int, block_size: int,
            scratch: MTPScratch | None) -> dict[int, MTPDraft]:
    """Drafts for the next step: the MTP layer over the step's rows whose next token is known (`hidden`: the target's
    final hidden state of every scheduled position, in order), then over its own drafts, one chain row per drafting
    sequence and forward, until each has `num_drafts`. `build_metadata`: the attention backend's, per forward."""
    if not any(next_tokens):
        return {}
    device = hidden.device
    batch, seq_index, rows = mtp_batch(scheduled, next_tokens, block_size, device)
    batch.attn_metadata = build_metadata(batch)
    logits, state = model.mtp_step(batch.input_ids, hidden.index_select(0, torch.tensor(rows, device=device)), batch)
    chains = _chains(scheduled, seq_index, next_tokens, num_drafts, max_model_len, block_size, scratch)
    conf, token = torch.softmax(logits, dim=-1).max(dim=-1)
    outputs, done = [(conf, token)], int(conf.shape[0])
    live = chains
    for i in range(1, num_drafts):
        live = [c for c in live if c.depth > i]
        if not live:
            break
        sel = torch.tensor([c.row for c in live], device=device)
        chain = _forward_batch(token.index_select(0, sel), [c.length - 2 + i for c in live], [1] * len(live),
                               [c.table for c in live], block_size, device)
        chain.attn_metadata = build_metadata(chain)
        logits, state = model.mtp_step(chain.input_ids, state.index_select(0, sel), chain)
        conf, token = torch.softmax(logits, dim=-1).max(dim=-1)
        for r, c in enumerate(live):
            c.row = r
            c.picks.append(done + r)
        outputs.append((conf, token))
        done += len(live)
    # One copy to the host for every draft of the step.
    confs = torch.cat([c for c, _ in outputs]).tolist()
    tokens = torch.cat([t for _, t in outputs]).tolist()
    return {c.seq_id: MTPDraft([tokens[p] for p in c.picks], [confs[p] for p in c.picks], c.length) for c in chains}


class MTPDrafter(ModelDrafter):
    """Serves the drafts the MTP layer made for each sequence in the step before (spec_decode/mtp.py); their
    confidences are the MTP's own probabilities of the tokens."""

    def tokens_and_confidences(self, draft) -> tuple[list[int], list[float]]:
        return draft.token_ids, draft.confidences
