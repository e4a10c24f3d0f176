"""Statistical proof that tree verification under sampling is lossless.

A synthetic target "model" gives logits as a function of the path (depth, parent token, token), so
the exact law of the first two emitted tokens is P(a) * P(b | a), both through `target_probs` (the
autoregressive sampler's distribution). A synthetic drafter draws every tree the way a real one
would (children from q with or without replacement, or top-k of q), the verifier runs on 200k
trees per case, and a G-test compares the emitted tokens with the exact law. The same test with an
acceptance probability biased by +0.02 must fail hard, so the test has the power to see a bias.

The trials run through `verify_sampling_batch`, the very code `verify_sampling` runs with one tree
(B = 1); a smaller test drives `verify_sampling` itself to pin the one-tree plumbing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from specwood.drafting.base import draft_probs
from specwood.sampling import SamplingParams, target_probs
from specwood.tree.token_tree import ChildRule, TokenTree
from specwood.verify import children_table, min_ratio, verify_sampling, verify_sampling_batch

from conftest import g_test

TRIALS = 200_000
PRE = 0  # the token before the root (the target conditions on it at the root)
ROOT = 1
EMITTED = 3  # the test checks the joint law of the first 1, 2 and 3 emitted tokens


def biased(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """A deliberately wrong verifier: accepts drafted tokens 2 points too often."""
    return min_ratio(p_x, q_x) + 0.02


pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")


@dataclass
class Case:
    name: str
    layout: list[int]  # children per node at each level
    rule: ChildRule
    params: SamplingParams
    vocab: int = 16
    without_replacement: bool = True
    inject: bool = False  # the root's first child is a token the draft gives probability 0
    seed: int = 0


CASES = [
    Case("chain1", [1], "sampled", SamplingParams(temperature=1.0), vocab=32, seed=1),
    Case("chain3_t0.8_p0.9", [1, 1, 1], "sampled", SamplingParams(temperature=0.8, top_p=0.9), vocab=32, seed=2),
    Case("3x2_repl_t1.3", [3, 2], "sampled", SamplingParams(temperature=1.3), without_replacement=False, seed=3),
    Case("3x2_norepl_t0.7_p0.9", [3, 2], "sampled", SamplingParams(temperature=0.7, top_p=0.9), seed=4),
    Case("4x4x2_repl_p0.95", [4, 4, 2], "sampled", SamplingParams(temperature=1.0, top_p=0.95),
         without_replacement=False, seed=5),
    # strong top-p: q often has fewer than 4 tokens, so drafting and verification exhaust q
    Case("4x4x2_norepl_t0.6_p0.8", [4, 4, 2], "sampled", SamplingParams(temperature=0.6, top_p=0.8), seed=6),
    Case("3x2_selected", [3, 2], "selected", SamplingParams(temperature=1.0), seed=7),
    Case("4x4x2_selected_t0.7_k8_p0.9", [4, 4, 2], "selected",
         SamplingParams(temperature=0.7, top_k=8, top_p=0.9), seed=8),
    Case("3x2_norepl_injected_t0.9", [3, 2], "sampled", SamplingParams(temperature=0.9), inject=True, seed=9),
]


@dataclass
class Layout:
    parents: list[int]
    depths: list[int]
    level_nodes: list[list[int]] = field(default_factory=list)

    @classmethod
    def build(cls, branching: list[int]) -> "Layout":
        parents, depths, levels = [-1], [0], [[0]]
        for k in branching:
            nxt = []
            for p in levels[-1]:
                for _ in range(k):
                    parents.append(p)
                    depths.append(depths[p] + 1)
                    nxt.append(len(parents) - 1)
            levels.append(nxt)
        return cls(parents, depths, levels)


def draw(q: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One token per row of q (unnormalised, >= 0) by inverse CDF: torch.multinomial is ~10x
    slower on many short rows. Zero-probability tokens are never drawn (the CDF does not rise)."""
    cdf = q.double().cumsum(1)
    u = torch.rand(q.shape[0], 1, generator=g, dtype=torch.float64) * cdf[:, -1:]
    return (cdf <= u).sum(1).clamp(max=q.shape[1] - 1)


class Synthetic:
    """Target logits T[depth, parent token, token] and draft q Q[depth, token] (distinct per depth)."""

    def __init__(self, case: Case) -> None:
        g = torch.Generator().manual_seed(1000 + case.seed)
        V, D = case.vocab, max(len(case.layout) + 1, EMITTED)
        self.case = case
        # the token's own part dominates so deep paths get accepted; the parent's part makes the
        # target depend on the path, the draft does not see it
        own = 2.0 * torch.randn(D, 1, V, V, generator=g)
        self.T = own + 0.7 * torch.randn(D, V, V, V, generator=g)
        # the draft resembles the target but is clearly not equal to it
        draft_logits = 0.8 * own[:, 0] + 1.0 * torch.randn(D, V, V, generator=g)
        self.Q = draft_probs(draft_logits, case.params)  # same filter the engine's drafter applies
        self.q_root = self.Q[0, ROOT].clone()
        self.injected = -1
        if case.inject:
            # the most likely target token that the drafter will never draw at the root
            p0 = target_probs(self.T[0, PRE, ROOT], case.params)
            self.injected = int(p0.argmax())
            self.q_root[self.injected] = 0.0
            self.q_root /= self.q_root.sum()

    def expected(self) -> list[np.ndarray]:
        """Exact law of the first m emitted tokens, m = 1..EMITTED ([V], [V, V], [V, V, V])."""
        prm = self.case.params
        laws = [target_probs(self.T[0, PRE, ROOT], prm).double()]
        laws.append(laws[0][:, None] * target_probs(self.T[1, ROOT], prm).double())  # [a, b]
        laws.append(laws[1][:, :, None] * target_probs(self.T[2], prm).double())  # T[2][a, b]: after a, b
        return [law.numpy() for law in laws[:EMITTED]]

    def draft(self, B: int, lay: Layout, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw B trees like a real drafter: tokens [B, n] and per-tree children tables [B, n, C]."""
        n = len(lay.parents)
        tokens = torch.zeros(B, n, dtype=torch.long)
        tokens[:, 0] = ROOT
        children = children_table(lay.parents).expand(B, -1, -1).clone()
        for level in lay.level_nodes[:-1]:
            for node in level:
                kids = children[0, node]
                kids = kids[kids >= 0].tolist()
                q = self.Q[lay.depths[node], tokens[:, node]] if node else self.q_root.expand(B, -1)
                sampled = kids
                if node == 0 and self.injected >= 0:
                    tokens[:, kids[0]] = self.injected
                    sampled = kids[1:]
                k = len(sampled)
                if self.case.rule == "selected":
                    tokens[:, sampled] = torch.topk(q, k, dim=1).indices
                elif not self.case.without_replacement:
                    tokens[:, sampled] = torch.stack([draw(q, g) for _ in range(k)], 1)
                else:
                    # draw, zero, renormalise; a tree with q exhausted gets no further children
                    q = q.clone()
                    alive = torch.ones(B, dtype=torch.bool)
                    for slot, c in enumerate(sampled, start=len(kids) - k):
                        safe = torch.where(alive.unsqueeze(1), q, torch.ones_like(q))
                        x = draw(safe, g).unsqueeze(1)
                        tokens[:, c] = x.squeeze(1)
                        children[~alive, node, slot] = -1
                        q = q.scatter(1, x, 0.0)
                        mass = q.sum(1, keepdim=True)
                        alive &= mass.squeeze(1) > 0
                        q = q / mass.clamp(min=1e-30)
        return tokens, children

    def rows(self, lay: Layout, tokens: torch.Tensor):
        depth = torch.tensor(lay.depths)
        parent = torch.tensor([max(p, 0) for p in lay.parents])

        def target_rows(rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
            tok = tokens[rows, nodes]
            ptok = torch.where(nodes == 0, PRE, tokens[rows, parent[nodes]])
            return self.T[depth[nodes], ptok, tok]

        def draft_rows(rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
            q = self.Q[depth[nodes], tokens[rows, nodes]]
            return torch.where((nodes == 0).unsqueeze(1), self.q_root, q)

        return target_rows, draft_rows


def run_case(case: Case, accept_prob, trials: int = TRIALS, syn: Synthetic | None = None
             ) -> tuple[list[float], list[int]]:
    """G-test p-values of the first 1, 2 and 3 emitted tokens; histogram of accepted lengths.
    `syn`: the tables to draft and verify with (default: the case's synthetic ones; a real
    model's in test_arch_statistics)."""
    syn, lay = syn or Synthetic(case), Layout.build(case.layout)
    V, n = case.vocab, len(lay.parents)
    g_draft = torch.Generator().manual_seed(case.seed)
    g_verify = torch.Generator().manual_seed(10_000 + case.seed)
    counts = torch.zeros(V**EMITTED, dtype=torch.long)
    accepted_len = torch.zeros(len(case.layout) + 1, dtype=torch.long)
    chunk = max(1, 1_500_000 // n)  # bounds the per-chunk tensors to a few tens of MB
    for start in range(0, trials, chunk):
        B = min(chunk, trials - start)
        tokens, children = syn.draft(B, lay, g_draft)
        target_rows, draft_rows = syn.rows(lay, tokens)
        out = verify_sampling_batch(
            tokens, children, target_rows, draft_rows, case.params, g_verify,
            child_rule=case.rule, without_replacement=case.without_replacement, accept_prob=accept_prob,
        )
        k, acc, ar = out.num_accepted, out.accepted, torch.arange(B)
        # emitted: the accepted path, then next_token, then (past it) the following plain
        # autoregressive steps, drawn from the target after the last two emitted tokens
        seq = torch.zeros(B, EMITTED, dtype=torch.long)
        for i in range(EMITTED):
            on_path = tokens[ar, acc[:, i].clamp(min=0)] if i < acc.shape[1] else out.next_token
            if i == 0:
                cont = out.next_token  # unused: token 0 is on the path or is next_token
            else:
                before = seq[:, i - 2] if i >= 2 else torch.full((B,), ROOT)
                cont = draw(target_probs(syn.T[i, before, seq[:, i - 1]], case.params), g_draft)
            seq[:, i] = torch.where(i < k, on_path, torch.where(i == k, out.next_token, cont))
        code = sum(seq[:, i] * V ** (EMITTED - 1 - i) for i in range(EMITTED))
        counts += torch.bincount(code, minlength=V**EMITTED)
        accepted_len += torch.bincount(k, minlength=len(accepted_len))
    joint = counts.reshape([V] * EMITTED).numpy()
    law = syn.expected()
    pvals = [g_test(joint.sum(axis=tuple(range(m, EMITTED))), law[m - 1]) for m in range(1, EMITTED + 1)]
    return pvals, accepted_len.tolist()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_lossless_and_powerful(case: Case) -> None:
    t0 = time.perf_counter()
    real, accepted_len = run_case(case, min_ratio)
    t1 = time.perf_counter()
    bias, _ = run_case(case, biased)
    t2 = time.perf_counter()
    fmt = lambda ps: " ".join(f"{p:.3g}" for p in ps)  # noqa: E731
    print(
        f"\n{case.name}: real p(1,2,3 tokens)=[{fmt(real)}] | biased [{fmt(bias)}] "
        f"| accepted lengths {accepted_len} | {t1 - t0:.1f}s + {t2 - t1:.1f}s"
    )
    assert min(real) > 1e-3, "the verifier's output law differs from the target's"
    assert min(bias[:2]) < 1e-6, "the test cannot see a +0.02 acceptance bias"


# --- the one-tree entry point: the same law through TokenTree + verify_sampling -----------------

def test_one_tree_entry_point_is_lossless() -> None:
    """Drives `verify_sampling` itself (TokenTree, child_dists dict, [n, V] logits). Fewer trials
    (one Python call each); top-k makes a biased verifier emit impossible tokens, so power stays."""
    case = Case("3x2_norepl_t0.8_k4_V8", [3, 2], "sampled", SamplingParams(temperature=0.8, top_k=4), vocab=8, seed=11)
    syn, lay = Synthetic(case), Layout.build(case.layout)
    V, n, N = case.vocab, len(lay.parents), 5000
    g_draft = torch.Generator().manual_seed(case.seed)
    tokens, children = syn.draft(N, lay, g_draft)
    assert bool((children >= 0).sum(-1).eq(children_table(lay.parents).ge(0).sum(-1)).all())  # q never exhausted
    target_rows, draft_rows = syn.rows(lay, tokens)
    nodes = torch.arange(n).repeat(N)
    trials = torch.arange(N).repeat_interleave(n)
    logits = target_rows(trials, nodes).reshape(N, n, V)
    dists = draft_rows(trials, nodes).reshape(N, n, V)
    internal = [i for i in range(n) if i in set(lay.parents)]
    for accept_prob, want_lossless in ((min_ratio, True), (biased, False)):
        g = torch.Generator().manual_seed(77)
        first, pair = np.zeros(V, dtype=np.int64), np.zeros((V, V), dtype=np.int64)
        for t in range(N):
            tree = TokenTree.with_root(ROOT, child_rule="sampled", without_replacement=True)
            for i in range(1, n):
                tree.add_node(lay.parents[i], int(tokens[t, i]))
            tree.child_dists = {i: dists[t, i] for i in internal}
            out = verify_sampling(tree, logits[t], case.params, g, accept_prob=accept_prob)
            emitted = out.tokens(tree)
            if len(emitted) < 2:
                emitted.append(int(draw(target_probs(syn.T[1, ROOT, emitted[0]], case.params)[None], g)))
            first[emitted[0]] += 1
            pair[emitted[0], emitted[1]] += 1
        law = syn.expected()
        p_first, p_pair = g_test(first, law[0]), g_test(pair, law[1])
        print(f"\nverify_sampling ({'real' if want_lossless else 'biased'}): "
              f"p(first)={p_first:.3g} p(pair)={p_pair:.3g}")
        if want_lossless:
            assert min(p_first, p_pair) > 1e-3
        else:
            assert min(p_first, p_pair) < 1e-6


# --- deterministic edge cases --------------------------------------------------------------------

def _tree(rule: ChildRule, layout: list[list[int]], tokens: list[int], wr: bool = True) -> TokenTree:
    """layout[i] = parent of node i + 1."""
    tree = TokenTree.with_root(ROOT, child_rule=rule, without_replacement=wr)
    for parent, tok in zip(layout, tokens):
        tree.add_node(parent, tok)
    return tree


def _is_path(tree: TokenTree, accepted: list[int]) -> bool:
    parent = 0
    for node in accepted:
        if tree.parents[node] != parent:
            return False
        parent = node
    return True


def test_identical_draft_accepts_first_child_every_time() -> None:
    # p == q: min(1, p/q) == 1 exactly, so the first child is always taken, down to the leaf
    V, params = 12, SamplingParams(temperature=0.9, top_p=0.8)
    tree = _tree("sampled", [0, 0, 1, 1, 3], [3, 4, 5, 6, 7])
    logits = torch.randn(len(tree), V, generator=torch.Generator().manual_seed(0))
    for node in (1, 3, 5):
        logits[tree.parents[node], tree.tokens[node]] += 6.0  # first children: top of p's nucleus
    for i in range(len(tree)):
        tree.child_dists[i] = target_probs(logits[i], params)
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        out = verify_sampling(tree, logits, params, g)
        assert out.accepted == [1, 3, 5]
        assert target_probs(logits[5], params)[out.next_token] > 0


def test_zero_target_probability_is_never_accepted_or_emitted() -> None:
    V, params = 10, SamplingParams(temperature=1.0, top_k=2)
    logits = torch.zeros(3, V)
    logits[0, [7, 8]] = 5.0  # the target only allows 7 and 8 after the root
    for rule in ("sampled", "selected"):
        tree = _tree(rule, [0, 0], [2, 3])
        tree.child_dists[0] = torch.full((V,), 1.0 / V)
        g = torch.Generator().manual_seed(2)
        for _ in range(100):
            out = verify_sampling(tree, logits, params, g)
            assert out.accepted == [] and out.next_token in (7, 8)


def test_vanishing_residual_falls_back_safely() -> None:
    # p one-hot on the drafted token and a verifier forced to reject: relu(p - q) is all zero and
    # p minus the token is all zero; the fallback must still emit a token of p's support
    V, params = 6, SamplingParams(temperature=1.0)
    logits = torch.full((2, V), -200.0)
    logits[:, 4] = 0.0
    never = lambda p_x, q_x: torch.zeros_like(p_x)  # noqa: E731
    for rule in ("sampled", "selected"):
        tree = _tree(rule, [0], [4])
        tree.child_dists[0] = target_probs(logits[0], params)
        out = verify_sampling(tree, logits, params, torch.Generator().manual_seed(3), accept_prob=never)
        assert out.accepted == [] and out.next_token == 4


def test_exhausted_draft_stops_trials() -> None:
    # q is one-hot on token 2, so no child after a rejected 2 can be a draw from q: stop and
    # sample the residual (DySpec Alg. 3 "D is all 0"), never accepting the stray second child
    V, params = 5, SamplingParams(temperature=1.0)
    logits = torch.full((3, V), -1e4)
    logits[0, [2, 3]] = 0.0  # p = 1/2 on 2 and 3
    tree = _tree("sampled", [0, 0], [2, 3])
    tree.child_dists[0] = torch.nn.functional.one_hot(torch.tensor(2), V).float()
    g = torch.Generator().manual_seed(4)
    seen = set()
    for _ in range(200):
        out = verify_sampling(tree, logits, params, g)
        assert out.accepted in ([1], []) and (out.accepted or out.next_token == 3)
        seen.add(tuple(out.accepted))
    assert seen == {(1,), ()}


def test_missing_child_dist_is_verified_as_selected() -> None:
    V, params = 4, SamplingParams(temperature=1.0)
    logits = torch.full((2, V), -1e4)
    logits[0, 1] = 0.0  # p one-hot on 1: accepted with probability p(1) = 1
    tree = _tree("sampled", [0], [1])  # no child_dists at all
    for _ in range(20):
        assert verify_sampling(tree, logits, params, None).accepted == [1]


def test_root_only_tree_samples_the_target() -> None:
    logits = torch.full((1, 5), -1e4)
    logits[0, 3] = 0.0
    for rule in ("sampled", "selected"):
        tree = TokenTree.with_root(ROOT, child_rule=rule)
        assert verify_sampling(tree, logits, SamplingParams(temperature=1.0), None).next_token == 3


def test_real_vocab_tree() -> None:
    """151,936-token rows, 128 nodes: valid verdicts for both rules, only visited rows touched."""
    V, n = 151_936, 128
    g = torch.Generator().manual_seed(5)
    logits = 3.0 * torch.randn(n, V, generator=g)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    for rule in ("sampled", "selected"):
        tree = TokenTree.with_root(ROOT, child_rule=rule, without_replacement=True)
        frontier = [0]
        while len(tree) < n:
            nxt = []
            for node in frontier:
                q = target_probs(logits[node] + torch.randn(V, generator=g), params)
                tree.child_dists[node] = q
                picks = torch.multinomial(q, 4, generator=g) if rule == "sampled" else torch.topk(q, 4).indices
                for tok in picks.tolist()[: n - len(tree)]:
                    nxt.append(tree.add_node(node, tok))
            frontier = nxt
        t0 = time.perf_counter()
        out = verify_sampling(tree, logits, params, g)
        dt = time.perf_counter() - t0
        print(f"\nreal vocab, {rule}: accepted {len(out.accepted)}, {dt * 1e3:.0f} ms")
        assert _is_path(tree, out.accepted)
        last = out.accepted[-1] if out.accepted else 0
        assert target_probs(logits[last], params)[out.next_token] > 0
