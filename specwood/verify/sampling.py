"""Lossless verification of a token tree under sampling (multi-candidate speculative sampling).

At each node, starting at the root, the target distribution p = target_probs(logits) (exactly what
the autoregressive sampler draws from) becomes the running residual r, and the children are tried
in their drafting order:

* drawn from the draft q ("sampled"): accept x with prob min(1, r(x)/q(x)); on rejection
  r <- norm(relu(r - q)); when drafted without replacement also q[x] <- 0, q <- norm(q), and an
  exhausted q ends the trials (DySpec Algorithm 3, SpecInfer / Sequoia).
* chosen deterministically ("selected"): q is one-hot on x, so accept with prob r(x); on rejection
  r[x] <- 0 and renormalise.

A node may have both kinds (a hybrid tree: the draft model's sampled children, then suffix
candidates, `TokenTree.selected`): the selected ones come after every sampled sibling, so each
sampled child is still a draw from q given the trials before it, and the selected rule holds for
a candidate of any law (its presence may depend on the sampled draws). An exhausted q then ends
only the sampled trials.

Accepting moves to that child and repeats; otherwise the correction is drawn from the residual.
Each trial step, given the candidate's conditional law, emits r exactly, so by induction the
token after every node is distributed as p, and the emitted sequence as autoregressive sampling.

Edge cases, kept lossless:
* a "sampled" child with q(x) == 0 cannot have been drawn from q (a drafter injected it, or q was
  recorded after a filter it was not drawn under). Accepting it whenever r(x) > 0 (ratio = inf)
  would bias towards it, so it is verified with the "selected" rule instead (one-hot q, no change
  to q), which is lossless for a candidate of *any* law; the same holds when a node lacks q.
* the residual mass sum(relu(r - q)) equals the probability of the rejection that produced it; when
  it is below _MIN_MASS (r == q up to rounding) the rejection was a numerical accident and the
  normalised residual would be rounding noise, so fall back to r with x removed. The error is
  bounded by that mass.

The core, `verify_sampling_batch`, verifies B trees at once (same node count, per-tree children
tables); `verify_sampling` is the one-tree entry point and runs through the same code with B = 1,
so the statistical tests that drive the batch core measure the verifier the engine uses.
Only rows of visited nodes are touched: the work is O(visited nodes x their children x V).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specwood.sampling import SamplingParams, allowed, sample_token, target_probs
from specwood.tree.token_tree import ChildRule, TokenTree
from specwood.verify.greedy import Verdict, children_lists, verify_greedy

# accept_prob(p_x, q_x) -> probability of accepting a drafted token (tensors, elementwise).
AcceptProb = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# rows(trials [b], nodes [b]) -> [b, V]: a row per (tree, node) pair, fetched only when visited.
RowFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# A rejection whose residual has less mass than this had (numerically) zero probability.
_MIN_MASS = 1e-6
_TINY = 1e-30


def min_ratio(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """The lossless acceptance probability min(1, p(x)/q(x)); the core guarantees q_x > 0."""
    return (p_x / q_x).clamp(max=1.0)


@dataclass
class BatchVerdict:
    accepted: torch.Tensor  # [B, D] long: accepted node indices per tree, -1 padded
    num_accepted: torch.Tensor  # [B] long
    next_token: torch.Tensor  # [B] long

    def verdict(self, b: int) -> Verdict:
        k = int(self.num_accepted[b])
        return Verdict(self.accepted[b, :k].tolist(), int(self.next_token[b]))


def children_table(parents: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, C] long: the children of each node in trial order, -1 padded at the end."""
    kids = children_lists(parents)
    width = max((len(k) for k in kids), default=0)
    rows = [k + [-1] * (width - len(k)) for k in kids]  # one tensor build, not one per node
    return torch.tensor(rows, dtype=torch.long, device=device).reshape(len(parents), width)


def verify_sampling_batch(
    tokens: torch.Tensor,
    children: torch.Tensor,
    target_logits: LogitsFn,
    draft_probs: RowFn | None,
    params: SamplingParams,
    generator: torch.Generator | None,
    *,
    child_rule: ChildRule = "sampled",
    without_replacement: bool = True,
    accept_prob: AcceptProb = min_ratio,
    selected: torch.Tensor | None = None,
) -> BatchVerdict:
    """Verify B trees of n nodes each.

    tokens [B, n]: token of every node. children [B, n, C]: each node's children in trial order,
    -1 padded at the end (a node may have fewer children in some trees). target_logits(trials,
    nodes) gives the target logits after those nodes; draft_probs(trials, nodes) the draft
    distribution their children were drawn from (None, or returning None: verify as "selected").
    selected [B, n] bool: nodes verified with the selected rule whatever `child_rule` says (each
    after all of its sampled siblings).
    """
    B, n = tokens.shape
    device = tokens.device
    accepted = torch.full((B, max(n - 1, 0)), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    next_token = torch.zeros(B, dtype=torch.long, device=device)
    width = children.shape[-1]
    sampled = child_rule == "sampled"

    rows = torch.arange(B, device=device)  # trees still walking
    nodes = torch.zeros(B, dtype=torch.long, device=device)  # their current node
    depth = 0
    while rows.numel():
        b = rows.numel()
        p = target_probs(target_logits(rows, nodes), params).clone()  # running residual, [b, V]
        q = draft_probs(rows, nodes) if (sampled and draft_probs is not None) else None
        q = q.float().clone() if q is not None else None
        kids = children[rows, nodes]  # [b, C]
        n_kids = (kids >= 0).sum(1)
        trying = n_kids > 0
        chosen = torch.full((b,), -1, dtype=torch.long, device=device)
        u = torch.rand(b, width, generator=generator, device=device)
        forced = None
        if selected is not None and q is not None:
            forced = selected[rows.unsqueeze(1), kids.clamp(min=0)] & (kids >= 0)  # [b, C]
            # a selected child at or after trial j: an exhausted q must not end the trials
            forced_later = forced.flip(1).cumsum(1).flip(1) > 0
        for j in range(width):
            live = (trying & (n_kids > j)).nonzero().squeeze(1)
            if live.numel() == 0:
                break
            child = kids[live, j]
            x = tokens[rows[live], child].unsqueeze(1)  # [m, 1]
            p_l = p[live]
            p_x = p_l.gather(1, x).squeeze(1)
            if q is not None:
                q_l = q[live]
                q_x = q_l.gather(1, x).squeeze(1)
                drawn = q_x > 0  # else x was not drawn from q: verify it as "selected"
                if forced is not None:
                    drawn = drawn & ~forced[live, j]
                ok = accept_prob(p_x, torch.where(drawn, q_x, torch.ones_like(q_x)))
            else:
                ok = accept_prob(p_x, torch.ones_like(p_x))
            acc = u[live, j] < ok
            chosen[live[acc]] = child[acc]
            trying[live[acc]] = False

            rej = ~acc
            if not bool(rej.any()):
                continue
            lr, xr, pr = live[rej], x[rej], p_l[rej]
            one_hot = torch.zeros_like(pr).scatter_(1, xr, 1.0)
            q_eff = one_hot if q is None else torch.where(drawn[rej].unsqueeze(1), q_l[rej], one_hot)
            resid = (pr - q_eff).clamp_(min=0.0)
            mass = resid.sum(1, keepdim=True)
            resid = resid / mass.clamp(min=_TINY)
            weak = mass.squeeze(1) < _MIN_MASS
            if bool(weak.any()):
                # Numerically impossible rejection: keep r without x (or r itself if x was all of it).
                alt = pr.scatter(1, xr, 0.0)
                alt_mass = alt.sum(1, keepdim=True)
                alt = torch.where(alt_mass > 0, alt / alt_mass.clamp(min=_TINY), pr)
                resid = torch.where(weak.unsqueeze(1), alt, resid)
            p[lr] = resid

            if q is not None and without_replacement:
                dr = drawn[rej]
                q_r = q_l[rej]
                q_z = q_r.scatter(1, xr, 0.0)
                q_mass = q_z.sum(1, keepdim=True)
                q[lr] = torch.where(dr.unsqueeze(1), q_z / q_mass.clamp(min=_TINY), q_r)
                # every token q could draw was tried: no further child can be a draw from q
                spent = dr & (q_mass.squeeze(1) <= 0)
                if forced is not None and j + 1 < width:
                    spent &= ~forced_later[lr, j + 1]
                trying[lr[spent]] = False

        moved = chosen >= 0
        if bool((~moved).any()):
            stop = (~moved).nonzero().squeeze(1)
            next_token[rows[stop]] = sample_token(p[stop], generator)
        go = moved.nonzero().squeeze(1)
        rows, nodes = rows[go], chosen[go]
        if rows.numel():
            accepted[rows, depth] = nodes
            num_accepted[rows] += 1
        depth += 1
    return BatchVerdict(accepted[:, :depth - 1 if depth else 0], num_accepted, next_token)


def verify_sampling(
    tree: TokenTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    accept_prob: AcceptProb = min_ratio,
) -> Verdict:
    """Verify one tree; `target_logits` is [len(tree), V] (row i: logits after node i)."""
    n = len(tree)
    if target_logits.shape[0] != n:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows for a tree of {n} nodes")
    device = target_logits.device
    tokens = torch.tensor(tree.tokens, dtype=torch.long, device=device).unsqueeze(0)
    children = children_table(tree.parents, device).unsqueeze(0)
    dists = tree.child_dists
    selected = None
    if tree.selected:
        selected = torch.zeros(1, n, dtype=torch.bool, device=device)
        selected[0, sorted(tree.selected)] = True

    def target_rows(_rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        return target_logits.index_select(0, nodes)

    def draft_rows(_rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor | None:
        q = dists.get(int(nodes[0]))  # B == 1: one node per step
        return None if q is None else q.to(device).reshape(1, -1)

    out = verify_sampling_batch(
        tokens, children, target_rows, draft_rows, params, generator,
        child_rule=tree.child_rule, without_replacement=tree.without_replacement, accept_prob=accept_prob,
        selected=selected,
    )
    return out.verdict(0)


def verify(
    tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> Verdict:
    """Greedy verification for greedy params, lossless speculative sampling otherwise."""
    if params.greedy:
        return verify_greedy(tree, allowed(target_logits, params))
    return verify_sampling(tree, target_logits, params, generator)
