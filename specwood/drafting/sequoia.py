"""Sequoia-style tree shapes: a dynamic program over a measured acceptance vector.

The acceptance vector a[k] (k = 0, 1, ...) is the probability that the k-th candidate drafted below
a node is accepted, given that the node itself was accepted and candidates 0..k-1 were rejected.
Under that (position-only) model the k-th child of a node is *the* accepted child with probability
w[k] = a[k] * prod_{j<k} (1 - a[j]), so a node whose path from the root uses ranks k1, k2, ... is
accepted with probability w[k1] * w[k2] * ..., and the expected number of accepted drafted tokens
of a tree is the sum of that product over its nodes. `sequoia_tree` finds the tree of at most n
nodes (and optional depth) that maximises it.

A tree is returned *positionally*: a list of (parent, rank) for nodes 1..n in BFS order (node 0 is
the root), siblings in rank order with contiguous ranks 0, 1, 2, ...
"""
from __future__ import annotations

from typing import Literal, Sequence

import numpy as np
import torch

# A rough prior for a small draft model against a larger target of the same family; measure the
# real vector with `estimate_acceptance_vector` on a calibration set.
DEFAULT_ACCEPTANCE: tuple[float, ...] = (0.70, 0.30, 0.18, 0.12, 0.09, 0.07, 0.05, 0.04)

Layout = list[tuple[int, int]]  # (parent index, rank) of nodes 1..n; node 0 is the root


def rank_weights(acceptance: Sequence[float]) -> list[float]:
    """w[k]: probability that the rank-k child is the accepted one, given its parent was accepted."""
    weights, reach = [], 1.0
    for a in acceptance:
        weights.append(reach * float(a))
        reach *= 1.0 - float(a)
    return weights


def expected_accepted(acceptance: Sequence[float], layout: Layout) -> float:
    """Expected number of accepted drafted tokens of a positional tree (the bonus token excluded)."""
    w = rank_weights(acceptance)
    value = [1.0]
    for parent, rank in layout:
        value.append(value[parent] * (w[rank] if rank < len(w) else 0.0))
    return float(sum(value[1:]))


def sequoia_tree(acceptance: Sequence[float], n: int, max_depth: int | None = None) -> Layout:
    """The positional tree of at most `n` drafted nodes (depth <= `max_depth`) with the largest
    expected number of accepted tokens. Nodes that would add nothing (ranks past the vector, or
    zero acceptance) are left out, so the tree can be smaller than `n`.

    W[d][s] is the best value of a subtree of at most s nodes (its root included) and depth <= d;
    C[d][i][r] the best value of spending at most i nodes on the children of rank >= r of one node:
        C[d][i][r] = max(0, max_{t=1..i} w[r] * (1 + W[d-1][t]) + C[d][i-t][r+1]),
        W[d][s] = C[d][s-1][0].
    Without a depth limit the single row refers to itself (W[t] for t <= i is already known).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    w = np.array(rank_weights(acceptance), dtype=np.float64)[: max(n, 1)]
    k = len(w)
    if n == 0 or k == 0 or (max_depth is not None and max_depth < 1):
        return []
    depth = max_depth if max_depth is not None and max_depth < n else None  # a limit >= n never binds
    free = depth is None
    rows = 1 if depth is None else depth + 1
    top = 0 if depth is None else depth  # the row that describes the whole tree
    wv = np.zeros((rows, n + 2))  # W; W[d][0] is never used (a child subtree has >= 1 node)
    cv = np.zeros((rows, n + 1, k + 1))  # C; C[.., r = k] = 0: no ranks left
    choice = np.zeros((rows, n + 1, k), dtype=np.int32)  # t chosen for (d, i, r); 0 = stop
    live = slice(0, 1) if free else slice(1, rows)  # rows computed (row 0 of a depth DP is a leaf)
    for i in range(1, n + 1):
        prev = wv[live] if free else wv[0 : rows - 1]  # W of the child subtrees' depth limit
        for r in range(k - 1, -1, -1):
            # candidate t = 1..i: rank-r child gets a subtree of t nodes, the later ranks i - t
            cand = w[r] * (1.0 + prev[:, 1 : i + 1]) + cv[live, i - 1 :: -1, r + 1]
            best_t = cand.argmax(axis=1)
            best = cand[np.arange(cand.shape[0]), best_t]
            take = best > 0.0
            cv[live, i, r] = np.where(take, best, 0.0)
            choice[live, i, r] = np.where(take, best_t + 1, 0)
        wv[live, i + 1] = cv[live, i, 0]
    return _unfold(choice, top, n, free)


def _unfold(choice: np.ndarray, top: int, n: int, free: bool) -> Layout:
    """Walk the DP choices breadth-first into a positional layout."""
    k = choice.shape[2]
    layout: Layout = []
    queue = [(0, top, n)]  # (node, depth row, nodes available for its descendants)
    head = 0
    while head < len(queue):
        node, row, avail = queue[head]
        head += 1
        r = 0
        while r < k and avail > 0:
            t = int(choice[row, avail, r])
            if t == 0:
                break
            layout.append((node, r))
            queue.append((len(layout), row if free else row - 1, t - 1))
            avail -= t
            r += 1
    return layout


AcceptRule = Literal["sampled", "selected"]


def estimate_acceptance_vector(
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    max_rank: int = 8,
    rule: AcceptRule = "sampled",
    samples: int = 16,
    generator: torch.Generator | None = None,
) -> list[float]:
    """Measure a[k] from matched rows of draft (q) and target (p) distributions, shape [N, V].

    a[k] = E[reach_k * accept_k] / E[reach_k] over rows (and, for "sampled", over candidate
    draws): the probability that the k-th candidate is accepted given that the first k-1 were
    rejected, pooled over the calibration positions. The verifier rules are mirrored exactly:
      * "selected": candidates are the top tokens of q; accept x with p(x), else zero p(x) and
        renormalise p (one-hot q). Computed exactly.
      * "sampled": candidates drawn from q without replacement; accept x with min(1, p(x)/q(x)),
        else p <- norm(relu(p - q)) then q drops x and renormalises. `samples` candidate
        sequences per row (Gumbel top-k); accept/reject is handled in expectation.
    A candidate that cannot exist (q has fewer than k+1 tokens) counts in neither sum.
    """
    q = draft_probs.detach().float().reshape(-1, draft_probs.shape[-1])
    p = target_probs.detach().float().reshape(-1, target_probs.shape[-1])
    if q.shape != p.shape:
        raise ValueError(f"draft and target probabilities differ in shape: {tuple(q.shape)} vs {tuple(p.shape)}")
    if rule not in ("sampled", "selected"):
        raise ValueError(f"rule must be 'sampled' or 'selected', got {rule!r}")
    ranks = min(max_rank, q.shape[-1])
    num = torch.zeros(ranks, dtype=torch.float64)
    den = torch.zeros(ranks, dtype=torch.float64)
    if rule == "selected":
        _selected_sums(q, p, ranks, num, den)
    else:
        # keep each chunk of (rows x samples x V) around 16M floats
        rows = max(1, (16 << 20) // max(1, samples * q.shape[-1]))
        for s in range(0, q.shape[0], rows):
            _sampled_sums(q[s : s + rows], p[s : s + rows], ranks, samples, generator, num, den)
    est = torch.where(den > 0, num / den.clamp(min=1e-300), torch.zeros_like(num))
    return [float(x) for x in est]


def _selected_sums(q: torch.Tensor, p: torch.Tensor, ranks: int, num: torch.Tensor, den: torch.Tensor) -> None:
    top_q, cand = torch.topk(q, ranks, dim=-1)
    pc = p.gather(1, cand).double()
    valid = top_q > 0
    # reach_k = prod_{j<k} (1 - p_res(x_j)) telescopes to 1 - sum_{j<k} p(x_j); reach_k*accept_k = p(x_k)
    reach = (1.0 - (pc.cumsum(1) - pc)).clamp(min=0.0)
    num += (pc * valid).sum(0)
    den += (reach * valid).sum(0)


def _sampled_sums(
    q: torch.Tensor, p: torch.Tensor, ranks: int, samples: int, generator: torch.Generator | None,
    num: torch.Tensor, den: torch.Tensor,
) -> None:
    q_cur = q.repeat_interleave(samples, dim=0)
    p_cur = p.repeat_interleave(samples, dim=0)
    # Gumbel top-k == sequential sampling without replacement, in draw order
    u = torch.rand(q_cur.shape, generator=generator).clamp_(min=1e-12, max=1.0 - 1e-7)
    keys = q_cur.log() - (-u.log()).log()
    cand = torch.topk(keys, ranks, dim=-1).indices
    valid = q_cur.gather(1, cand) > 0
    reach = torch.ones(q_cur.shape[0], dtype=torch.float64)
    for k in range(ranks):
        x = cand[:, k : k + 1]
        px, qx = p_cur.gather(1, x).squeeze(1), q_cur.gather(1, x).squeeze(1)
        ok = valid[:, k] & (qx > 0)
        acc = torch.where(ok, (px / qx.clamp(min=1e-30)).clamp(max=1.0), torch.zeros_like(px)).double()
        num[k] += (reach * acc)[ok].sum()
        den[k] += reach[ok].sum()
        reach = reach * (1.0 - acc)
        p_cur = _renorm((p_cur - q_cur).clamp_(min=0.0))
        q_cur = _renorm(q_cur.scatter(1, x, 0.0))


def _renorm(d: torch.Tensor) -> torch.Tensor:
    s = d.sum(-1, keepdim=True)
    return torch.where(s > 0, d / s.clamp(min=1e-30), torch.zeros_like(d))
