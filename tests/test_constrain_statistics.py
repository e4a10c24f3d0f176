"""Statistical proof that verification stays lossless with per-path processors (grammar mask,
penalties, logit_bias, min_p): the verifier-level pattern of test_verify_statistics.py.

A small vocabulary (8 tokens) and a real llguidance grammar with forced chains ("ab", "dd") and a
branching point; the real `Processors` turn synthetic target and draft logits into the processed
rows of every path up to depth 2 (the penalties make them depend on the whole path). Trees are
drafted from the processed draft q (sampled children always allowed), or -- "selected" -- from
the unprocessed draft's top tokens, like prompt lookup, with the refused candidates pruned by the
grammar before verification. 200k trees per case; a G-test compares the first 1, 2 and 3 emitted
tokens with the exact law of `ar` with the same processors, and a verifier biased by +0.02 must
fail the same test.
"""
from __future__ import annotations

import llguidance
import pytest
import torch
from llguidance._tokenizer import TokenizerWrapper

from specwood.constrain.processors import Processors
from specwood.drafting.base import draft_probs
from specwood.sampling import SamplingParams, target_probs
from specwood.verify import children_table, min_ratio, verify_sampling_batch

from conftest import g_test
from test_verify_statistics import EMITTED, Layout, biased, draw

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")

TRIALS = 200_000
V = 8
EOS = 7
ROOT = 2  # "c": the committed root, a point where the grammar branches
GRAMMAR = llguidance.LLMatcher.grammar_from_lark('start: ("ab" | "c" | "dd")+ "."')


class TinyVocab:
    """Single-character tokens for llguidance: a b c d . e f <eos> (e, f never allowed)."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [b"a", b"b", b"c", b"d", b".", b"e", b"f", b"<eos>"]
    special_token_ids = [EOS]

    def __call__(self, s: bytes | str) -> list[int]:
        data = s.encode() if isinstance(s, str) else s
        return [self.tokens.index(bytes([c])) for c in data if bytes([c]) in self.tokens]


def processors(params: SamplingParams) -> Processors:
    ll = llguidance.LLTokenizer(TokenizerWrapper(TinyVocab()))
    proc = Processors(params, [0, 3, 3], V, llguidance.LLMatcher(ll, GRAMMAR, log_level=0), {EOS})
    proc.commit([ROOT])
    return proc


def all_paths() -> list[tuple[int, ...]]:
    """Paths of length 0, 1, 2 in the order code() numbers them."""
    return [()] + [(a,) for a in range(V)] + [(a, b) for a in range(V) for b in range(V)]


def code(depth: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Row index of a path of `depth` tokens (first, second) in all_paths() order."""
    return torch.where(depth == 0, 0, torch.where(depth == 1, 1 + first, 1 + V + first * V + second))


CASES = [
    ("sampled_norepl_penalties", [3, 2], "sampled",
     SamplingParams(temperature=1.0, frequency_penalty=1.2, presence_penalty=0.6, repetition_penalty=1.5,
                    grammar=GRAMMAR, logit_bias=((3, 1.5),)), 1),
    ("chain_min_p_t0.8", [1, 1], "sampled",
     SamplingParams(temperature=0.8, min_p=0.1, frequency_penalty=-0.8, grammar=GRAMMAR), 2),
    ("selected_pruned_penalties", [3, 2], "selected",
     SamplingParams(temperature=1.0, repetition_penalty=0.7, presence_penalty=1.0, grammar=GRAMMAR), 3),
]


def run_case(layout, rule, params, seed, accept_prob, trials=TRIALS):
    g = torch.Generator().manual_seed(seed)
    proc = processors(params)
    paths = all_paths()
    depth_of = torch.tensor([len(p) for p in paths])
    last = torch.tensor([p[-1] if p else ROOT for p in paths])
    # synthetic logits by (depth, last token): the processors add the path dependence
    base_t = 2.0 * torch.randn(3, V, V, generator=g)
    base_q = 0.8 * base_t + torch.randn(3, V, V, generator=g)
    P_rows = proc.rows(base_t[depth_of, last], paths)  # processed target logits per path
    Q_rows = proc.rows(base_q[depth_of, last], paths)
    valid = torch.tensor(proc.valid(paths))
    assert int((~valid).sum()) > 10  # the grammar refuses many paths: pruning has work to do
    P = target_probs(P_rows, params)
    Q = draft_probs(Q_rows, params) if rule == "sampled" else draft_probs(base_q[depth_of, last], params)

    lay = Layout.build(layout)
    n = len(lay.parents)
    g_draft = torch.Generator().manual_seed(100 + seed)
    g_verify = torch.Generator().manual_seed(200 + seed)
    counts = torch.zeros(V ** EMITTED, dtype=torch.long)
    chunk = 50_000
    for start in range(0, trials, chunk):
        B = min(chunk, trials - start)
        tokens = torch.full((B, n), ROOT, dtype=torch.long)
        children = children_table(lay.parents).expand(B, -1, -1).clone()

        def node_code(node: int) -> torch.Tensor:
            d = lay.depths[node]
            p = lay.parents[node]
            first = tokens[:, node] if d == 1 else tokens[:, max(p, 0)]
            return code(torch.full((B,), d), first, tokens[:, node])

        for level in lay.level_nodes[:-1]:
            for node in level:
                kids = [c for c in children[0, node].tolist() if c >= 0]
                q = Q[node_code(node)]
                if rule == "selected":  # the top tokens of the unprocessed draft: some refused
                    tokens[:, kids] = torch.topk(q, len(kids), dim=1).indices
                    continue
                q = q.clone()
                alive = torch.ones(B, dtype=torch.bool)
                for slot, c in enumerate(kids):
                    x = draw(torch.where(alive.unsqueeze(1), q, torch.ones_like(q)), g_draft).unsqueeze(1)
                    tokens[:, c] = x.squeeze(1)
                    children[~alive, node, slot] = -1
                    q = q.scatter(1, x, 0.0)
                    mass = q.sum(1, keepdim=True)
                    alive &= mass.squeeze(1) > 0
                    q = q / mass.clamp(min=1e-30)
        node_codes = torch.stack([node_code(i) for i in range(n)], 1)  # [B, n]
        if rule == "selected":  # prune refused candidates (their subtrees are below them)
            ok = valid[node_codes]
            kid_ok = torch.where(children >= 0,
                                 ok.gather(1, children.clamp(min=0).reshape(B, -1)).reshape(children.shape),
                                 torch.zeros_like(children, dtype=torch.bool))
            order = torch.sort((~kid_ok).to(torch.int8), dim=2, stable=True).indices
            children = torch.where(kid_ok, children, -1).gather(2, order)
        else:
            listed = children[:, 0]  # the root's children that were drawn
            first = torch.where(listed >= 0, valid[node_codes.gather(1, listed.clamp(min=0))], True)
            assert bool(first.all())  # drawn from the masked q: never refused

        def target_rows(rows, nodes):
            return P_rows[node_codes[rows, nodes]]

        def draft_rows(rows, nodes):
            return Q[node_codes[rows, nodes]]

        out = verify_sampling_batch(tokens, children, target_rows, draft_rows if rule == "sampled" else None,
                                    params, g_verify, child_rule=rule, accept_prob=accept_prob)
        k, acc, ar = out.num_accepted, out.accepted, torch.arange(B)
        seq = torch.zeros(B, EMITTED, dtype=torch.long)
        for i in range(EMITTED):
            on_path = tokens[ar, acc[:, i].clamp(min=0)] if i < acc.shape[1] else out.next_token
            cont = out.next_token
            if i:
                c = code(torch.full((B,), i), seq[:, 0], seq[:, i - 1])
                cont = draw(P[c], g_draft)
            seq[:, i] = torch.where(i < k, on_path, torch.where(i == k, out.next_token, cont))
        counts += torch.bincount(sum(seq[:, i] * V ** (EMITTED - 1 - i) for i in range(EMITTED)),
                                 minlength=V ** EMITTED)
    joint = counts.reshape([V] * EMITTED).numpy()
    law1 = P[0].double()
    law2 = law1[:, None] * P[1:1 + V].double()
    law3 = law2[:, :, None] * P[1 + V:].double().reshape(V, V, V)
    laws = [law1.numpy(), law2.numpy(), law3.numpy()]
    return [g_test(joint.sum(axis=tuple(range(m, EMITTED))), laws[m - 1]) for m in range(1, EMITTED + 1)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_processed_verification_is_lossless_and_powerful(case):
    name, layout, rule, params, seed = case
    real = run_case(layout, rule, params, seed, min_ratio)
    bias = run_case(layout, rule, params, seed, biased)
    print(f"\n{name}: real p={[f'{p:.3g}' for p in real]} biased p={[f'{p:.3g}' for p in bias]}")
    assert min(real) > 1e-3, "the verifier's output law differs from constrained ar's"
    assert min(bias) < 1e-6, "the test cannot see a +0.02 acceptance bias"
