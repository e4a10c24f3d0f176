"""Lossless verification of a drafted token tree against the target's logits."""
from specwood.verify.greedy import Verdict, children_lists, verify_greedy
from specwood.verify.sampling import (
    AcceptProb,
    BatchVerdict,
    children_table,
    min_ratio,
    tree_uniforms,
    verify,
    verify_sampling,
    verify_sampling_batch,
    verify_trees,
)

__all__ = [
    "AcceptProb",
    "BatchVerdict",
    "Verdict",
    "children_lists",
    "children_table",
    "min_ratio",
    "tree_uniforms",
    "verify",
    "verify_greedy",
    "verify_sampling",
    "verify_sampling_batch",
    "verify_trees",
]
