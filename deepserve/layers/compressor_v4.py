"""KV compressors of DeepSeek-V4 (transformers' DeepseekV4CSACompressor / DeepseekV4HCACompressor / the indexer's
own compressor; docs/deepseek_v4.md §2), behind the compressor contract of layers/compressor.py:

    ratio        tokens per entry; entry j completes at token (j + 1)·ratio - 1
    span         consecutive tokens entry j pools: positions (j + 1)·ratio - span ... (j + 1)·ratio - 1
    state_width  fp32 values kept per token in the paged compressor state
    token_state(x [T, H]) -> [T, state_width]        once per token, from the layer's normed attention input
    pool(states [N, span, state_width], valid [N, span], entry_index [N]) -> [N, D] entries before RoPE
                                                    (the compressor's RMSNorm is applied inside pool)

The caller applies RoPE (the compress theta / YaRN of the layer) at `entry_rope_position(j, ratio)`.

Both V4 compressors pool by a per-channel softmax over the span of (gate + ape), the learned position bias `ape`
being indexed by the token's place inside its own ratio-window:
    HCA (heavily compressed, span = ratio):   c_j = Σ_{s<r} softmax_s(g_{jr+s} + ape[s]) ⊙ kv_{jr+s}
    CSA (compressed sparse, span = 2·ratio):  wkv / wgate / ape have 2·D columns, two series a = [:D], b = [D:];
        entry j pools window j-1 through series a and window j through series b, in one softmax over 2r slots:
        c_j = Σ_{s<r} w^a_s ⊙ kv^a_{(j-1)r+s} + Σ_{s<r} w^b_s ⊙ kv^b_{jr+s}, with logits g^a_{(j-1)r+s} + ape^a[s]
        and g^b_{jr+s} + ape^b[s]; window -1 (entry 0) does not exist: its slots weigh 0.
    then entry = RMSNorm(norm)(c_j).
The indexer's key compressor is a CSA compressor at index_head_dim (`indexer_key_compressor`).

Parameter names are the released checkpoint's (`layers.L.attn.compressor.{wkv,wgate}.weight`, `.ape`,
`.norm.weight`; `layers.L.attn.indexer.compressor.*` for the indexer's), so a module placed at `attn.compressor`
/ `attn.indexer.compressor` loads them without renaming.
"""

from __future__ import annotations

import torch
from torch import nn

from deepserve.kernels.reference.norm import rms_norm
from deepserve.layers.linear import Linear
from deepserve.layers.norm import RMSNorm


def entry_rope_position(j, ratio: int):
    """RoPE position of compressed entry j (int or tensor): j·ratio, the first token of its own window, for CSA and
    HCA alike (transformers: `arange(n_windows) * compress_rate`)."""
    return j * ratio


class WindowPoolCompressor(nn.Module):
    """Gated pooling of `span` tokens into one entry of `head_dim` values; `series` = 2 for CSA's overlapping
    windows (two column halves of wkv / wgate / ape), 1 for HCA's disjoint ones."""

    def __init__(self, ratio: int, hidden_size: int, head_dim: int, eps: float, overlap: bool) -> None:
        super().__init__()
        if ratio <= 0:
            raise ValueError(f"a V4 compressor needs a positive ratio, got {ratio}")
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        series = 2 if overlap else 1
        self.span = series * ratio
        width = series * head_dim
        self.state_width = 2 * width                      # (kv, gate) of both series, raw: ape is added per slot
        self.wkv = Linear(hidden_size, width, bias=False)
        self.wgate = Linear(hidden_size, width, bias=False)
        # fp32, as transformers keeps position_bias (_keep_in_fp32_modules_strict); zeros = its init.
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, eps)

    def token_state(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, state_width] fp32: (kv, gate) projections of each token, independent of its neighbours,
        so a token's state is written once and read back by every entry whose span covers it."""
        return torch.cat((self.wkv(x).float(), self.wgate(x).float()), dim=-1)

    def pool(self, states: torch.Tensor, valid: torch.Tensor, entry_index: torch.Tensor) -> torch.Tensor:
        """states [N, span, state_width], valid [N, span] (False for positions < 0), entry_index [N] (unused: the
        ape depends on a slot's place in its window, not on j) -> [N, head_dim] in the weights' dtype, normed,
        before RoPE."""
        kv, gate = self._slots(states.float())
        gate = gate.masked_fill(~valid[..., None], float("-inf"))       # missing tokens weigh 0
        c = (gate.softmax(dim=1) * kv).sum(dim=1)
        # transformers multiplies by the fp32 norm weight before its one cast; rms_norm does the same in fp32.
        return rms_norm(c, self.norm.weight.float(), self.norm.eps).to(self.wkv.weight.dtype)

    def _slots(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per slot of the span: (kv, gate + ape) [N, span, head_dim], picking each slot's series for CSA."""
        kv, gate = states.chunk(2, dim=-1)
        ape = self.ape.float()
        if not self.overlap:
            return kv, gate + ape
        r, D = self.ratio, self.head_dim
        # Slots [0, r) are window j-1 read through series a; slots [r, 2r) are window j through series b.
        kv = torch.cat((kv[:, :r, :D], kv[:, r:, D:]), dim=1)
        gate = torch.cat((gate[:, :r, :D] + ape[:, :D], gate[:, r:, D:] + ape[:, D:]), dim=1)
        return kv, gate


class CSACompressor(WindowPoolCompressor):
    """Compressed sparse attention's compressor (ratio 4 in the release): overlapping spans of 2·ratio tokens."""

    def __init__(self, ratio: int, hidden_size: int, head_dim: int, eps: float) -> None:
        super().__init__(ratio, hidden_size, head_dim, eps, overlap=True)


class HCACompressor(WindowPoolCompressor):
    """Heavily compressed attention's compressor (ratio 128 in the release): disjoint spans of ratio tokens."""

    def __init__(self, ratio: int, hidden_size: int, head_dim: int, eps: float) -> None:
        super().__init__(ratio, hidden_size, head_dim, eps, overlap=False)


def indexer_key_compressor(ratio: int, hidden_size: int, index_head_dim: int, eps: float) -> CSACompressor:
    """The CSA indexer's keys: its own CSA compressor at index_head_dim over the same windows (transformers'
    DeepseekV4Indexer kv_proj / gate_proj / position_bias / kv_norm); its norm plays V4.1's k_norm and there is
    no wk. RoPE'd at entry_rope_position like the KV entries."""
    return CSACompressor(ratio, hidden_size, index_head_dim, eps)


def span_positions(entry_index: torch.Tensor, ratio: int, span: int) -> torch.Tensor:
    """[N] entry indices -> [N, span] token positions each entry pools (negative = before the sequence)."""
    return (entry_index[:, None] + 1) * ratio - span + torch.arange(span, device=entry_index.device)


def compress_sequence(compressor: WindowPoolCompressor, x: torch.Tensor) -> torch.Tensor:
    """Every complete entry of one whole sequence x [T, H] -> [T // ratio, head_dim] before RoPE: what
    transformers' no-cache forward computes (the trailing partial window is dropped)."""
    states = compressor.token_state(x)
    j = torch.arange(x.shape[0] // compressor.ratio, device=x.device)
    pos = span_positions(j, compressor.ratio, compressor.span)
    return compressor.pool(states[pos.clamp(min=0)], pos >= 0, j)


__all__ = ["CSACompressor", "HCACompressor", "WindowPoolCompressor", "compress_sequence", "entry_rope_position",
           "indexer_key_compressor", "span_positions"]
