"""PyTorch math of mHC (deepinfer.md §2.4, §16.5): the CPU path and the twin GPU kernels are tested against.
Per token, fp32; layers/hyper_connection.py holds the parameters and says what the pieces mean."""

from __future__ import annotations

import torch


def hc_mix(R: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, iters: int, post_mult: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """R [T, m, H] -> (pre [T, m], post [T, m], C [T, m, m]) fp32: mix = (fn · z) · rsqrt(mean(z²) + norm_eps)
    ⊙ [scale0 x m, scale1 x m, scale2 x m²] + base; pre = sigmoid + hc_eps, post = post_mult · sigmoid,
    C = Sinkhorn(mix[2m:] as m x m, C[i, j] = mix[2m + i·m + j])."""
    T, m, _ = R.shape
    z = R.reshape(T, -1).float()                                       # stream-major (§16.5)
    mix = (z @ fn.float().T) * torch.rsqrt(z.square().mean(-1, keepdim=True) + norm_eps)
    s = scale.float()
    mix = mix * torch.cat((s[0].expand(m), s[1].expand(m), s[2].expand(m * m))) + base.float()
    pre = torch.sigmoid(mix[:, :m]) + hc_eps
    post = post_mult * torch.sigmoid(mix[:, m:2 * m])
    return pre, post, sinkhorn(mix[:, 2 * m:].view(T, m, m), hc_eps, iters)


def sinkhorn(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """[..., m, m] -> doubly stochastic: softmax over rows' entries + eps, column-normalise, then (iters - 1) times
    row- and column-normalise (each denominator + eps), as §2.4 step 4 says."""
    C = logits.softmax(-1) + eps
    C = C / (C.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdim=True) + eps)
        C = C / (C.sum(-2, keepdim=True) + eps)
    return C


def combine_streams(R: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i R_i: R [T, m, H], weights [T, m] -> [T, H] in R's dtype (fp32 accumulation)."""
    return torch.bmm(weights.float().unsqueeze(1), R.float()).squeeze(1).to(R.dtype)


def write_back(R: torch.Tensor, y: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """R'_j = post_j · y + Σ_i C[i, j] R_i (output stream j sums column j of C), stored in R's dtype."""
    mixed = torch.bmm(C.transpose(1, 2), R.float())                       # [T, m, H]
    return mixed.addcmul_(post.unsqueeze(-1), y.float().unsqueeze(1)).to(R.dtype)


def first_pre(T: int, m: int, device: torch.device) -> torch.Tensor:
    """The shifted variant's pre for the model's first sublayer: one-hot (1, 0, ..., 0) per token."""
    pre = torch.zeros(T, m, device=device)
    pre[:, 0] = 1.0
    return pre
