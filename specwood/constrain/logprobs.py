"""Log-probabilities of the emitted tokens, as OpenAI's `logprobs` / `top_logprobs` report them.

They are the target's log-softmax of the *processed* logits (grammar mask, logit_bias, penalties:
specwood.constrain.processors) before temperature, top-k, min-p and top-p -- the model's own
distribution under the request's constraints, independent of how it is then sampled. They are
read from the verify forward's row of the node before each emitted token, which is the row `ar`
computes at the same prefix, so every method reports what `ar` would.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the best alternatives, most likely first


def path_logprobs(rows: torch.Tensor, nodes: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """tokens[i] was emitted after node nodes[i], whose processed logits are rows[nodes[i]]."""
    lp = torch.log_softmax(rows[nodes].float(), dim=-1)
    picked = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    best = lp.topk(top, dim=-1) if top else None
    out = []
    for i, (t, v) in enumerate(zip(tokens, picked)):
        alts = list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else []
        out.append(TokenLogprob(int(t), float(v), [(a, b) for a, b in alts if b > float("-inf")]))
    return out
