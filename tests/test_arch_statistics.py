"""Sampling stays lossless on the new architectures' own logits: a tiny Qwen3-MoE and a tiny
Gemma 3 (sliding window 8, crossed by the trees), each with a perturbed copy as its draft model.

The verifier-level test of test_verify_statistics (200,000 trees through verify_sampling_batch, a
G-test of the first 1, 2 and 3 emitted tokens against their exact law, a +0.02-biased twin that
must fail) runs here on tables read from the models instead of synthetic ones:

* the target's and the draft's logits for every node a tree can hold (the root: the prompt's
  last token; every token after it; every pair of tokens after that) come from ONE tree forward
  of each model over the full tree of depth 2 (1 + V + V^2 nodes), the way a verify step runs:
  a tree mask over a prefilled cache, the window of a sliding layer counted from each node's own
  position, every expert run once over the rows routed to it;
* the exact law comes from plain causal forwards of every prompt + (a, b) sequence, a separate
  path through the model; the two agree to 1e-4 (asserted), as the tree forward promises.
"""
from __future__ import annotations

import time

import pytest
import torch

from conftest import perturbed_copy
from specwood.drafting.base import draft_probs
from specwood.models.prefill import prefill
from specwood.models.testing import random_state_dict, random_tiny_config
from specwood.models.transformer import build_model
from specwood.sampling import SamplingParams, target_probs
from specwood.verify import min_ratio
from test_verify_statistics import PRE, ROOT, TRIALS, Case, Synthetic, biased, run_case

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")

V = 16
# 12 tokens ending in ROOT: the root sits at position 11, its grandchildren at 13, so a window
# of 8 leaves the prompt's first tokens out of every node's view, a different few for each depth
PROMPT = [5, 9, 3, 14, 7, 2, 11, 0, 6, 13, 4, ROOT]


# the output head's scale for next-token laws neither flat nor one-hot (mean largest probability
# 0.61 and 0.58 at temperature 1): Qwen3-MoE's own head, Gemma 3's tied table (x 8 at the input)
HEAD_SCALE = {"qwen3moe": 3.0, "gemma3": 0.15}


def tiny_pair(arch: str):
    """A tiny random target of `arch` with a 16-token vocabulary and its draft (a perturbed copy)."""
    config = random_tiny_config(arch, vocab_size=V, bos_token_id=None, eos_token_ids=[])
    sd = random_state_dict(config, seed=7)
    sd["output.weight" if "output.weight" in sd else "tok_embeddings.weight"] *= HEAD_SCALE[arch]
    target = build_model(config, sd, torch.float32, max_positions=64)
    return target, perturbed_copy(target, 0.3, seed=8)


def full_tree_logits(model, prompt: list[int]) -> torch.Tensor:
    """Logits [1 + V + V^2, V] of the full tree of depth 2 after `prompt`: the root (its last
    token), then every token a after it, then every pair (a, b), in one tree forward over the
    prefilled prompt[:-1]."""
    n = len(prompt) - 1
    tokens = [prompt[-1]] + list(range(V)) + [b for _ in range(V) for b in range(V)]
    parents = [-1] + [0] * V + [1 + a for a in range(V) for _ in range(V)]
    depths = [0] + [1] * V + [2] * V * V
    N = len(tokens)
    mask = torch.zeros(N, n + N, dtype=torch.bool)
    mask[:, :n] = True
    for i in range(N):
        node = i
        while node >= 0:
            mask[i, n + node] = True
            node = parents[node]
    cache = model.new_cache(n + N)
    prefill(model, cache, prompt[:-1])
    with torch.inference_mode():
        return model(torch.tensor([tokens]), torch.tensor(depths) + n, mask, cache, torch.arange(n, n + N))[0]


def plain_logits(model, prompt: list[int]) -> torch.Tensor:
    """The same rows [1 + V + V^2, V] from plain causal forwards of prompt + (a, b) for every a, b."""
    seqs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
    with torch.inference_mode():
        out = model(seqs, torch.arange(seqs.shape[1]))[:, -3:]  # after the prompt, after a, after (a, b)
    return torch.cat([out[0, :1], out[::V, 1], out[:, 2]])


class ModelTables(Synthetic):
    """Synthetic's tables (T[depth, parent token, token] for the target, Q[depth, token] for the
    draft) filled from a model pair's full-tree forwards; the exact law from plain forwards."""

    def __init__(self, case: Case, target, draft) -> None:
        self.case, self.injected = case, -1
        tree = full_tree_logits(target, PROMPT)
        plain = plain_logits(target, PROMPT)
        diff = (tree - plain).abs().max().item()
        assert diff <= 1e-4, f"a tree node's logits differ from its path's plain forward by {diff}"
        self.T = torch.zeros(3, V, V, V)
        self.T[0, PRE, ROOT] = tree[0]
        self.T[1, ROOT] = tree[1:1 + V]
        self.T[2] = tree[1 + V:].reshape(V, V, V)
        q = draft_probs(full_tree_logits(draft, PROMPT)[:1 + V], case.params)
        self.q_root = q[0]
        self.Q = torch.zeros(3, V, V)
        self.Q[1] = q[1:]  # after the root's child a: the draft's law of a's children
        self.plain = plain

    def expected(self) -> list:
        prm, plain = self.case.params, self.plain
        first = target_probs(plain[0], prm).double()
        second = target_probs(plain[1:1 + V], prm).double()  # [a, b]
        third = target_probs(plain[1 + V:], prm).double().reshape(V, V, V)  # [a, b, c]
        pair = first[:, None] * second
        return [first.numpy(), pair.numpy(), (pair[:, :, None] * third).numpy()]


CASES = {
    "qwen3moe": Case("qwen3moe_3x2_norepl_t1", [3, 2], "sampled", SamplingParams(temperature=1.0), vocab=V, seed=21),
    "gemma3": Case("gemma3_3x2_norepl_t0.8_p0.95", [3, 2], "sampled", SamplingParams(temperature=0.8, top_p=0.95),
                   vocab=V, seed=22),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_sampling_on_the_models_logits_is_lossless_and_powerful(arch: str) -> None:
    case = CASES[arch]
    target, draft = tiny_pair(arch)
    t0 = time.perf_counter()
    tables = ModelTables(case, target, draft)
    t1 = time.perf_counter()
    real, accepted_len = run_case(case, min_ratio, TRIALS, tables)
    t2 = time.perf_counter()
    bias, _ = run_case(case, biased, TRIALS, tables)
    t3 = time.perf_counter()
    fmt = lambda ps: " ".join(f"{p:.3g}" for p in ps)  # noqa: E731
    print(f"\n{case.name}: real p(1,2,3 tokens)=[{fmt(real)}] | biased [{fmt(bias)}] | accepted lengths "
          f"{accepted_len} | tables {t1 - t0:.1f}s, {t2 - t1:.1f}s + {t3 - t2:.1f}s")
    assert accepted_len[1] > TRIALS // 10 and accepted_len[2] > TRIALS // 10, "drafts rarely accepted: a weak test"
    assert min(real) > 1e-3, f"the verifier's output law differs from the {arch} model's"
    assert min(bias[:2]) < 1e-6, "the test cannot see a +0.02 acceptance bias"
