"""Greedy and temperature / top-k / top-p sampling; the seeded random stream belongs to one request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [..., V] float32 -> the distribution we sample from after temperature, top-k and top-p."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row, distributed as probs: argmax of p / E with E ~ Exp(1) i.i.d. (the exponential race).
    Unlike torch.multinomial it never waits for the device, which keeps a sampled cycle at one host sync."""
    # clamped: an exact 0 draw would make 0 / 0 = NaN for a token of probability 0, and argmax picks NaN
    race = torch.empty_like(probs).exponential_(1.0, generator=generator).clamp_min_(1e-30)
    return (probs / race).argmax(-1)


def accept_greedy(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance of a verify pass over tokens [1, k + 1] (t_n, then the k drafts) with logits [k + 1, V]:
    [m, the target's argmax per position (k + 1), the drafts (k)], one vector the host reads in one copy; m is
    the longest prefix where the target's argmax equals the draft."""
    drafts, targets = tokens[0, 1:], logits.argmax(-1)
    m = (targets[:-1] == drafts).int().cumprod(0).sum().view(1)
    return torch.cat([m, targets, drafts])


def verify_sampled(logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, params: SamplingParams,
                   generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al., Chen et al.): accept draft i with probability min(1, p(d)/q(d));
    at the first rejection sample from norm(max(0, p - q)); after k acceptances sample the bonus from p.

    p and q are the target's and drafter's distributions after the same temperature / top-k / top-p; q=None
    means the drafter proposed deterministically (a point mass). The output is distributed exactly as plain
    sampling. Each cycle draws k uniforms then k + 1 categorical samples from the request's generator, whatever
    is accepted, so a seed reproduces the text at a given depth. Returns (m [1], token per position [k + 1]).
    """
    p = probabilities(logits, params)
    k = drafts.shape[0]
    rows = torch.arange(k, device=p.device)
    p_d = p[rows, drafts]
    q_d = q[rows, drafts] if q is not None else torch.ones_like(p_d)
    u = torch.rand(k, generator=generator, device=p.device)
    m = (u * q_d < p_d).int().cumprod(0).sum().view(1)
    residual = p.clone()
    if q is not None:
        residual[:k] = (p[:k] - q).clamp_min(0)
    else:
        residual[rows, drafts] = 0.0
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)  # p == q: rejection had probability 0
    return m, sample(residual, generator)
