"""Per-path logits processors: grammar mask, logit_bias, repetition/frequency/presence penalties.

Each is a function of the prefix only (the grammar's state after it, token counts in it), so at a
tree node it is evaluated for the path to that node: the committed state (prompt + every emitted
token, the tree's root included) plus the drafted tokens from the root down to the node. Plain
decoding (a lone root) and every speculative method call the same `rows`, before temperature,
top-k, min-p and top-p (specwood.sampling.target_probs), so `ar` defines the distribution and the
verifiers preserve it. The order, as vLLM's: grammar mask, logit_bias, then the penalties.

Penalties follow OpenAI/vLLM: presence and frequency count the generated tokens only,
repetition_penalty (HF/vLLM) every token of prompt + output (a positive logit is divided by it, a
negative one multiplied).

The grammar's matcher holds the committed state. Paths are walked with `try_consume_tokens` and
`rollback` (sorted, so shared prefixes are consumed once) and the matcher is always rolled back
to the committed state: it only ever commits tokens it has validated, and a path it refuses marks
that node invalid instead of putting the matcher in its (sticky) error state.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from specwood.sampling import SamplingParams
from specwood.tree.token_tree import TokenTree

Path = tuple[int, ...]  # drafted tokens after the committed state (root excluded)
_BITS = torch.arange(32, dtype=torch.int32)


def _tally(path: Path, V: int) -> dict[int, int]:
    counts: dict[int, int] = {}
    for t in path:
        if t < V:
            counts[t] = counts.get(t, 0) + 1
    return counts


def tree_paths(tree: TokenTree, nodes: Sequence[int] | None = None) -> list[Path]:
    """The path of every node (or of `nodes`): the tokens from below the root down to it."""
    paths: list[Path] = [()]
    for i in range(1, len(tree)):  # parents precede children
        paths.append(paths[tree.parents[i]] + (tree.tokens[i],))
    return paths if nodes is None else [paths[i] for i in nodes]


class Processors:
    """One request's per-path processors and their committed state (see the module)."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, matcher: Any = None,
                 eos_ids: set[int] | None = None):
        self.params = params
        self.vocab_size = V = vocab_size
        self.matcher = matcher
        self.eos_ids = set(eos_ids or ())
        self.bias: torch.Tensor | None = None
        if params.logit_bias:
            self.bias = torch.zeros(V)
            for token, value in params.logit_bias:
                if token < V:
                    self.bias[token] += float(value)
        counting = bool(params.presence_penalty or params.frequency_penalty)
        self.counts = torch.zeros(V) if counting else None  # generated tokens
        self.seen: torch.Tensor | None = None  # prompt + generated, for repetition_penalty
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(V, dtype=torch.bool)
            self.seen[torch.tensor([t for t in prompt_ids if 0 <= t < V], dtype=torch.long)] = True
        self._masks: dict[Path, torch.Tensor | None] = {}  # this step's allowed-token rows by path
        self.emitted = 0
        self.pruned = 0  # drafted nodes the grammar refused, removed before the target forward
        self.forced = 0  # tokens the grammar forced, verified as free candidates
        self.mask_s = 0.0  # time in the grammar matcher (masks, forced runs, commits), for the stats

    # --- grammar ------------------------------------------------------------------------------

    def allowed(self, paths: Sequence[Path]) -> list[torch.Tensor | None]:
        """Per path: the grammar's allowed tokens after it ([V] bool), or None where the grammar
        refuses the path itself. Cached until the next commit (drafting and verification ask for
        the same paths)."""
        todo = sorted({p for p in paths if p not in self._masks})
        if todo:
            self._walk(todo)
        return [self._masks[p] for p in paths]

    def _walk(self, paths: list[Path]) -> None:
        t0 = time.perf_counter()
        try:
            self._walk_paths(paths)
        finally:
            self.mask_s += time.perf_counter() - t0

    def _walk_paths(self, paths: list[Path]) -> None:
        m = self.matcher
        bitmask = torch.zeros(len(paths), (self.vocab_size + 31) // 32, dtype=torch.int32)
        stack: list[int] = []  # tokens consumed beyond the committed state
        valid = []
        for i, path in enumerate(paths):  # sorted: a path's prefixes come before it
            common = 0
            for a, b in zip(stack, path):
                if a != b:
                    break
                common += 1
            if len(stack) > common:
                m.rollback(len(stack) - common)
                del stack[common:]
            rest = list(path[common:])
            took = m.try_consume_tokens(rest) if rest else 0
            stack.extend(rest[:took])
            ok = took == len(rest) and not m.is_error()
            valid.append(ok)
            if ok:  # (llguidance.torch's helper would import torch.compile's machinery: seconds)
                row = bitmask[i]
                m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if stack:
            m.rollback(len(stack))
        if m.is_error():
            raise RuntimeError(f"grammar matcher failed while walking a tree: {m.get_error()}")
        bits = self._widen(((bitmask.unsqueeze(-1) >> _BITS) & 1).reshape(len(paths), -1).bool(), self.vocab_size)
        for i, path in enumerate(paths):
            self._masks[path] = bits[i] if valid[i] else None

    def forced_run(self, limit: int) -> list[int]:
        """The tokens the grammar forces after the committed state (llguidance's fast-forward
        tokens: canonical, not unique, so they must still be verified), at most `limit`."""
        m = self.matcher
        if m is None or m.is_stopped() or limit <= 0:
            return []
        t0 = time.perf_counter()
        run = list(m.compute_ff_tokens())[:limit]
        self.mask_s += time.perf_counter() - t0
        ok = self.valid([tuple(run[:i + 1]) for i in range(len(run))])
        return run[:ok.index(False)] if False in ok else run

    def valid(self, paths: Sequence[Path]) -> list[bool]:
        """Whether the grammar accepts each path (always, without a grammar)."""
        if self.matcher is None:
            return [True] * len(paths)
        return [m is not None for m in self.allowed(paths)]

    # --- the transform ------------------------------------------------------------------------

    def rows(self, logits: torch.Tensor, paths: Sequence[Path]) -> torch.Tensor:
        """Processed float32 logits [len(paths), V'] (a copy): row i is `logits[i]` after the
        prefix committed + paths[i]. A path the grammar refuses keeps its row unmasked (such a
        node is unreachable: its token has probability zero at its parent).

        The committed part of the penalties is applied to all rows at once (broadcast over [V]);
        the few tokens of each path are then corrected one by one, so the cost is O(n V) dense
        ops plus O(path tokens), not an [n, V] count table per step."""
        out = logits.float().clone()
        n, V = out.shape
        if n == 0:
            return out
        dev = out.device
        if self.matcher is not None:
            every = torch.ones(self.vocab_size, dtype=torch.bool)
            keep = torch.stack([every if a is None else a for a in self.allowed(paths)])
            out.masked_fill_(~self._widen(keep, V).to(dev), float("-inf"))
        if self.bias is not None:
            out += self._widen(self.bias, V).to(dev)
        if self.seen is None and self.counts is None:
            return out
        per_row = [_tally(p, V) for p in paths]  # {token: count in the path}, per row
        p = self.params
        if self.seen is not None:
            rp = p.repetition_penalty
            seen = self._widen(self.seen, V)
            out = torch.where(seen.to(dev), torch.where(out > 0, out / rp, out * rp), out)
            fresh = [(i, t) for i, tally in enumerate(per_row) for t in tally if not seen[t]]
            if fresh:
                r, t = (torch.tensor(x, dtype=torch.long, device=dev) for x in zip(*fresh))
                v = out[r, t]
                out[r, t] = torch.where(v > 0, v / rp, v * rp)
        if self.counts is not None:
            base = self._widen(self.counts, V)
            out -= (p.frequency_penalty * base + p.presence_penalty * (base > 0).float()).to(dev)
            pairs = [(i, t, c) for i, tally in enumerate(per_row) for t, c in tally.items()]
            if pairs:
                row_ids, token_ids, counts = zip(*pairs)
                r, t = torch.tensor(row_ids, dtype=torch.long), torch.tensor(token_ids, dtype=torch.long)
                extra = p.frequency_penalty * torch.tensor(counts, dtype=torch.float32) \
                    + p.presence_penalty * (base[t] == 0).float()  # the path makes the token present
                out.index_put_((r.to(dev), t.to(dev)), -extra.to(dev), accumulate=True)
        return out

    @staticmethod
    def _widen(t: torch.Tensor, V: int) -> torch.Tensor:
        """`t` cut or zero-padded to V entries in its last dimension (a draft's vocabulary may differ)."""
        if t.shape[-1] >= V:
            return t[..., :V]
        pad = torch.zeros(*t.shape[:-1], V - t.shape[-1], dtype=t.dtype)
        return torch.cat([t, pad], -1)

    def tree_rows(self, tree: TokenTree, logits: torch.Tensor, nodes: Sequence[int] | None = None) -> torch.Tensor:
        """`rows` for the nodes of a tree (all of them, or `nodes`; logits row i <-> node i)."""
        return self.rows(logits, tree_paths(tree, nodes))

    # --- committing ---------------------------------------------------------------------------

    def commit(self, tokens: Sequence[int]) -> None:
        """The request emitted `tokens` (in order, the new root last): the committed state moves
        on. Nothing after an EOS is output, so it stops there."""
        self._masks.clear()
        taken: list[int] = []
        for t in tokens:
            taken.append(int(t))
            if t in self.eos_ids:
                break
        if self.matcher is not None and taken:
            t0 = time.perf_counter()
            m = self.matcher
            ok = m.validate_tokens(taken)  # never put an unvalidated token into the matcher
            if ok < len(taken) and not (ok == len(taken) - 1 and taken[-1] in self.eos_ids):
                # only an EOS after the grammar already stopped may be refused: nothing follows it
                raise RuntimeError(f"the grammar refuses emitted token {taken[ok]} (a processing bug)")
            if ok and not m.consume_tokens(taken[:ok]):
                raise RuntimeError(f"grammar matcher failed: {m.get_error()}")
            self.mask_s += time.perf_counter() - t0
        for t in taken:
            if t < self.vocab_size:
                if self.counts is not None:
                    self.counts[t] += 1
                if self.seen is not None:
                    self.seen[t] = True
        self.emitted += len(taken)
