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
tables). `verify_trees` verifies the trees of many requests in one call, each walking on uniforms
drawn from its own generator (`tree_uniforms`), so every verdict is exactly the one its tree gets
alone: `verify_sampling` is that with one tree. The statistical tests that drive the batch core
measure the verifier the engine uses. Only rows of visited nodes are touched: the work is
O(visited nodes x their children x V).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specwood.sampling import SamplingParams, allowed, draw_token, law_key, sample_token, target_probs
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

    def verdicts(self) -> list[Verdict]:
        """Every tree's verdict (one host copy, not one per tree)."""
        accepted, counts, nexts = self.accepted.tolist(), self.num_accepted.tolist(), self.next_token.tolist()
        return [Verdict(a[:k], t) for a, k, t in zip(accepted, counts, nexts)]


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
    uniforms: torch.Tensor | None = None,
) -> BatchVerdict:
    """Verify B trees of n nodes each.

    tokens [B, n]: token of every node. children [B, n, C]: each node's children in trial order,
    -1 padded at the end (a node may have fewer children in some trees). target_logits(trials,
    nodes) gives the target logits after those nodes; draft_probs(trials, nodes) the draft
    distribution their children were drawn from (None, or returning None: verify as "selected";
    a row of zeros does the same for one tree). selected [B, n] bool: nodes verified with the
    selected rule whatever `child_rule` says (each after all of its sampled siblings).

    The random draws: with `uniforms` [B, L, C + 1] (float64; L: the deepest tree's levels),
    tree b at its d-th visited node tries child j on uniforms[b, d, j] and draws the token it
    emits there from uniforms[b, d, C]; without, they come from `generator`, level by level.
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
        if uniforms is not None:
            u = uniforms[rows, depth]  # [b, C + 1]
        else:
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
            if uniforms is not None:
                next_token[rows[stop]] = draw_token(p[stop], u[stop, width])
            else:
                next_token[rows[stop]] = sample_token(p[stop], generator)
        go = moved.nonzero().squeeze(1)
        rows, nodes = rows[go], chosen[go]
        if rows.numel():
            accepted[rows, depth] = nodes
            num_accepted[rows] += 1
        depth += 1
    return BatchVerdict(accepted[:, :depth - 1 if depth else 0], num_accepted, next_token)


def tree_uniforms(tree: TokenTree, generator: torch.Generator | None, device: torch.device | str = "cpu"
                  ) -> torch.Tensor:
    """The uniforms verifying `tree` may use, drawn from its request's `generator`: [L, C + 1]
    float64, L = the tree's levels, C = the most children a node has; at the d-th node visited,
    child j is tried on [d, j] and the emitted token drawn from [d, C]. A tree takes the same
    draws alone or among others (`verify_trees`): a request's randomness is its own. A lone
    root takes one, as `next_token` does."""
    width = max((len(k) for k in children_lists(tree.parents)), default=0)
    return torch.rand(tree.max_depth + 1, width + 1, dtype=torch.float64, generator=generator, device=device)


def verify_trees(
    trees: list[TokenTree],
    target_logits: list[torch.Tensor],
    params: list[SamplingParams],
    uniforms: list[torch.Tensor],
    accept_prob: AcceptProb = min_ratio,
) -> list[Verdict]:
    """Verify many requests' trees in one batched walk per kind of tree (sampling law, child
    rule, with or without replacement). target_logits[i] is [len(trees[i]), V] (row k: logits
    after node k); uniforms[i] comes from `tree_uniforms(trees[i], ...)`, so verdict i is the one
    trees[i] gets alone with the same draws."""
    for tree, logits in zip(trees, target_logits):
        if logits.shape[0] != len(tree):
            raise ValueError(f"target_logits has {logits.shape[0]} rows for a tree of {len(tree)} nodes")
    verdicts: list[Verdict | None] = [None] * len(trees)
    kinds: dict[tuple, list[int]] = {}
    for i, tree in enumerate(trees):
        kinds.setdefault((law_key(params[i]), tree.child_rule, tree.without_replacement), []).append(i)
    for members in kinds.values():
        out = _verify_kind([trees[i] for i in members], [target_logits[i] for i in members], params[members[0]],
                           [uniforms[i] for i in members], accept_prob)
        for i, v in zip(members, out.verdicts()):
            verdicts[i] = v
    return verdicts  # type: ignore[return-value]


def _verify_kind(trees: list[TokenTree], logits: list[torch.Tensor], params: SamplingParams,
                 uniforms: list[torch.Tensor], accept_prob: AcceptProb) -> BatchVerdict:
    """`verify_trees` for trees of one kind: padded to the largest (padding nodes are no node's
    child, so never visited), rows fetched per visited (tree, node) pair."""
    device = logits[0].device
    B, n = len(trees), max(len(t) for t in trees)
    tables = [children_table(t.parents) for t in trees]
    width = max(t.shape[1] for t in tables)
    levels = max(u.shape[0] for u in uniforms)
    tokens = torch.zeros(B, n, dtype=torch.long)
    children = torch.full((B, n, width), -1, dtype=torch.long)
    u = torch.zeros(B, levels, width + 1, dtype=torch.float64, device=device)
    selected = torch.zeros(B, n, dtype=torch.bool) if any(t.selected for t in trees) else None
    for b, (tree, table, ub) in enumerate(zip(trees, tables, uniforms)):
        m, c = table.shape
        tokens[b, :m] = torch.tensor(tree.tokens)
        children[b, :m, :c] = table
        u[b, :ub.shape[0], :c] = ub[:, :c]
        u[b, :ub.shape[0], width] = ub[:, c]  # the emitted token's draw: the last column
        if selected is not None and tree.selected:
            selected[b, sorted(tree.selected)] = True

    def target_rows(rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        return torch.stack([logits[b][k] for b, k in zip(rows.tolist(), nodes.tolist())])

    def draft_rows(rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor | None:
        qs = [trees[b].child_dists.get(k) for b, k in zip(rows.tolist(), nodes.tolist())]
        if all(q is None for q in qs):
            return None
        V = next(q for q in qs if q is not None).shape[-1]
        zero = torch.zeros(V, device=device)  # no q at that node: its children verified as "selected"
        return torch.stack([zero if q is None else q.to(device).float().reshape(-1) for q in qs])

    return verify_sampling_batch(
        tokens.to(device), children.to(device), target_rows, draft_rows, params, None, child_rule=trees[0].child_rule,
        without_replacement=trees[0].without_replacement, accept_prob=accept_prob,
        selected=None if selected is None else selected.to(device), uniforms=u)


def verify_sampling(
    tree: TokenTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    accept_prob: AcceptProb = min_ratio,
) -> Verdict:
    """Verify one tree; `target_logits` is [len(tree), V] (row i: logits after node i)."""
    uniforms = tree_uniforms(tree, generator, target_logits.device)
    return verify_trees([tree], [target_logits], [params], [uniforms], accept_prob)[0]


def verify(
    tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> Verdict:
    """Greedy verification for greedy params, lossless speculative sampling otherwise."""
    if params.greedy:
        return verify_greedy(tree, allowed(target_logits, params))
    return verify_sampling(tree, target_logits, params, generator)
