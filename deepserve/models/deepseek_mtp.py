"""DeepSeek-V3's multi-token-prediction (MTP) module: the drafter of `speculative_config={"method": "mtp"}`.

V3 checkpoints hold `num_nextn_predict_layers` (1) extra layers after the last decoder layer,
`model.layers.{N}.*` with N = num_hidden_layers. The module predicts the token two positions ahead:

    x_i      = eh_proj( [ enorm(embed(t_{i+1})) ; hnorm(h_i) ] )     h_i: the target's final (normed) hidden state
    y        = decoder layer N (MLA over its own latent cache at positions i, then MoE), pre-norm residual
    logits_i = shared_head.head( shared_head.norm(y_i) )             predicts t_{i+2}

so once t_{m} is known (sampled at position m), row m - 1 (input h_{m-1} and t_m) drafts t_{m+1}; applied again at
position m with its own output state in place of h_m and t_{m+1}'s draft, it drafts t_{m+2}, and so on. The layer keeps a
KV cache like any decoder layer (its attention is one more entry of `attention_layers()`, paged with the same block
tables): every computed position also runs through it, so its keys are there when a later row attends to them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepserve.layers.forward_batch import ForwardBatch
from deepserve.layers.linear import Linear
from deepserve.layers.norm import RMSNorm


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.head = Linear(hidden, vocab, bias=False)


class MultiTokenPredictor(nn.Module):
    def __init__(self, cfg: dict[str, Any], block: nn.Module) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.shared_head = SharedHead(hidden, cfg["vocab_size"], eps)

    def forward(self, token_embeds: torch.Tensor, target_hidden: torch.Tensor,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [len(batch.logits_indices), V], the hidden states the head read for them). Row i drafts the token
        two positions after row i's position. Every row runs through the layer (its keys are written); only the rows
        in logits_indices get logits.

        The hidden state returned is shared_head.norm's output: a final, normed state like the target's h_i, which
        is what drafting more than one token feeds back in place of the target's at the next position
        (spec_decode/mtp.py; SGLang's choice too)."""
        x = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(target_hidden)], dim=-1))
        x, residual = self.block(x, None, batch)
        rows = batch.logits_rows
        y = self.shared_head.norm(rows(x)) if residual is None else self.shared_head.norm(rows(x), rows(residual))[0]
        return self.shared_head.head(y).float(), y
