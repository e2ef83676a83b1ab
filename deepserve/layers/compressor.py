"""KV compressors of DeepSeek-V4.1 (deepinfer.md §2.6, §16.7) and the step driver that runs any compressor over
the paged caches.

A compressor turns every `ratio` consecutive tokens into one compressed entry. Its contract (shared with the V4
compressors of layers/compressor_v4.py):

    ratio        tokens per entry; entry j completes at token (j + 1)·ratio - 1
    span         how many consecutive tokens entry j pools, the last being (j + 1)·ratio - 1
    state_width  fp32 values kept per token (in the paged compressor state) until its entries are pooled
    token_state(x [T, H]) -> [T, state_width]
    pool(states [N, span, state_width], valid [N, span], entry_index [N]) -> [N, D] entries before RoPE

`compress_step` writes this step's token states into the paged state, then pools every entry whose last token
is in the step, reading the span's earlier tokens back from the state: a chunk boundary or a decode step in the
middle of an entry needs nothing else (the half-done entry's first token waits in the paged state).

A decode-only step pools a (possible) entry for every row and sends the ones its row does not complete to the
scratch slot (layers/paged_state.py): shapes fixed by the row count, no host sync, so a CUDA graph can capture it.
Other steps select the completing rows (a prompt chunk completes T / ratio entries, not T).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepserve.layers.linear import Linear
from deepserve.layers.norm import RMSNorm
from deepserve.layers.paged_state import PagedState, RowSlots


class GatedPoolCompressor(nn.Module):
    """V4.1's C1 / C2 (§2.6): `wkv` [D, H], `wgate` [D, H] (ratio 2 only), `norm` [D].
      C1: c_t = wkv · x_t.    C2: c_j = Σ_{t in block j} softmax_t(wgate · x_t) ⊙ (wkv · x_t)  (per channel).
    pool returns RMSNorm(norm)(c): the "pre-RoPE" compressed vector (§2.6 post-processing)."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, eps: float) -> None:
        super().__init__()
        if ratio not in (1, 2):
            raise ValueError(f"a V4.1 compressor has ratio 1 or 2, not {ratio}")
        self.ratio = self.span = ratio
        self.head_dim = head_dim
        self.state_width = head_dim if ratio == 1 else 2 * head_dim
        self.wkv = Linear(hidden, head_dim, bias=False)
        if ratio == 2:
            self.wgate = Linear(hidden, head_dim, bias=False)
        self.norm = RMSNorm(head_dim, eps)

    def token_state(self, x: torch.Tensor) -> torch.Tensor:
        lat = self.wkv(x).float()
        if self.ratio == 1:
            return lat
        return torch.cat((self.wgate(x).float(), lat), dim=-1)             # (score, latent)

    def pool(self, states: torch.Tensor, valid: torch.Tensor, entry_index: torch.Tensor) -> torch.Tensor:
        dtype = self.wkv.weight.dtype
        if self.ratio == 1:
            c = states[:, 0]
        else:
            score, lat = states.split(self.head_dim, dim=-1)                # [N, 2, D] each
            score = score.masked_fill(~valid[..., None], float("-inf"))
            c = (score.softmax(dim=1) * lat).sum(1)
        return self.norm(c.to(dtype))


@dataclass
class NewEntries:
    """The entries one KV source completed this step, over all sequences: pre-RoPE values, their cache slots and
    their entry indices (RoPE position = index · ratio). In a decode-only step, one per row, slot -1 (the scratch
    slot) where the row completes none."""
    pre_rope: torch.Tensor        # [N, D]
    slots: torch.Tensor           # [N]
    index: torch.Tensor           # [N]


def compress_step(compressor: nn.Module, x: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
                  rows: RowSlots, state: PagedState, decode_only: bool = False) -> NewEntries:
    """Write x's token states at `slot_mapping`, then pool the entries completed this step (see module doc): entry
    j completes at the row of its last token, (j + 1)·ratio - 1, so each such row yields one entry."""
    state.write(slot_mapping, compressor.token_state(x))
    r, span = compressor.ratio, compressor.span
    completes = (positions + 1) % r == 0
    if decode_only:
        completed = rows                            # every row; those that complete nothing write the scratch slot
        j = ((positions + 1) // r - 1).clamp(min=0)
    else:
        done = completes.nonzero().squeeze(1)
        completed = rows.select(done)
        j = (positions[done] + 1) // r - 1
    span_positions = j[:, None] * r + torch.arange(r - span, r, device=x.device)[None, :]      # [N, span]
    slots = completed.token_slots(span_positions)
    states = state.read(slots.flatten()).view(*slots.shape, state.width).float()
    entry_slots = completed.entry_slots(j[:, None], r)[:, 0]
    if decode_only:                                 # padding rows of a captured decode (slot -1) complete nothing
        entry_slots = torch.where(completes & (slot_mapping >= 0), entry_slots, -1)
    return NewEntries(compressor.pool(states, span_positions >= 0, j), entry_slots, j)
