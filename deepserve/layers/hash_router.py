"""DeepSeek-V4's hash router (transformers' DeepseekV4HashRouter; docs/deepseek_v4.md §5): the first
`num_hash_layers` MoE layers choose their experts by a frozen token-id table, `ids = tid2eid[input_id]`, and
only weigh them by the learned gate:

    s = score(x @ W^T)  (fp32; sqrt(softplus) in V4)      w = s[ids] / (Σ s[ids] + 1e-20) · routed_scaling_factor

No correction bias (hash layers have none), no top-k. Same call shape as layers.moe.Router plus the token ids:
`forward(x, input_ids, expert_load) -> (weights [T, k] fp32, ids [T, k] int64)`. Checkpoint names:
`ffn.gate.weight` and `ffn.gate.tid2eid` (integer [V, k], stored as is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.kernels.reference.moe import RoutingConfig, count_expert_load

# The scoring functions RoutingConfig accepts, on fp32 gate logits.
SCORES = {"softmax": lambda z: z.softmax(dim=-1), "sigmoid": torch.sigmoid,
          "sqrtsoftplus": lambda z: F.softplus(z).sqrt()}


class HashRouter(nn.Module):
    """`weight` [E, H] (the gate, in `dtype`, as Router), `tid2eid` [vocab, top_k] int64 (a persistent buffer:
    its values come from the checkpoint). cfg.top_k, scoring, renormalize and scaling_factor are used;
    topk_method and groups are not (nothing is selected)."""

    def __init__(self, hidden_size: int, num_experts: int, vocab_size: int, cfg: RoutingConfig,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg, self.num_experts = cfg, num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        self.register_buffer("tid2eid", torch.zeros(vocab_size, cfg.top_k, dtype=torch.int64))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, E] fp32: the gate GEMM in the gate's dtype."""
        return F.linear(x.to(self.weight.dtype), self.weight).float()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, expert_load: torch.Tensor | None = None):
        """x [T, H], input_ids [T] (the token at each row's own position) -> (weights [T, k] fp32, ids [T, k]
        int64); with `expert_load` ([E] int64) each expert's count among the ids is added to it."""
        ids = self.tid2eid[input_ids.reshape(-1)].long()
        weights = SCORES[self.cfg.scoring](self.logits(x)).gather(1, ids)
        if self.cfg.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)     # transformers' epsilon
        weights = weights * self.cfg.scaling_factor
        if expert_load is not None:
            count_expert_load(expert_load, ids)
        return weights, ids

    def check_table(self) -> None:
        """After loading: every tid2eid entry must name an expert (a bad table would index out of range later)."""
        bad = (self.tid2eid < 0) | (self.tid2eid >= self.num_experts)
        if bool(bad.any()):
            row = int(bad.any(dim=1).nonzero()[0])
            raise ValueError(f"tid2eid[{row}]={self.tid2eid[row].tolist()}: expert ids must be in "
                             f"[0, {self.num_experts})")


def hash_routing_config(top_k: int, routed_scaling_factor: float, scoring: str = "sqrtsoftplus") -> RoutingConfig:
    """The RoutingConfig of a V4 hash layer: always renormalised (transformers ignores norm_topk_prob), scaled."""
    return RoutingConfig(top_k=top_k, scoring=scoring, renormalize=True, scaling_factor=routed_scaling_factor)


__all__ = ["HashRouter", "hash_routing_config"]
