"""One decode step for a batch of requests: draft every tree (draft calls batched), ONE target
forward over all of them (padded, per-row positions, slots and masks), verify them (the sampled
trees in one batched call, each on its own request's random draws), commit."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specwood.constrain.drafting import drafting_after, forced_run, forced_tree, processed_drafting, prune_refused
from specwood.drafting.base import Drafting
from specwood.drafting.together import draft_together
from specwood.engine.request import Request
from specwood.models.batch import RowInput, forward_rows_features
from specwood.models.cache import KVCache
from specwood.models.transformer import Transformer
from specwood.sampling import draw_token, law_key, next_token, target_probs, without_padding
from specwood.tree.token_tree import TokenTree
from specwood.verify import Verdict, tree_uniforms, verify, verify_trees
from specwood.constrain.logprobs import path_logprobs


@dataclass
class StepRecord:
    """What one step did and cost the whole batch: for metrics, per request (tree nodes drafted,
    accepted, max depth); for the requests' stats and `auto`, the drafting and target-forward
    time and how many requests drafted (their fair share of the drafting is what `auto` learns
    batched drafting's real price from)."""

    batch_size: int
    tokens: int  # target forward rows (tree nodes, roots included)
    draft_s: float
    verify_s: float
    drafts: list[tuple[int, int, int]] = field(default_factory=list)
    drafting: int = 0  # requests whose tree had drafted nodes
    prefill_tokens: int = 0  # newcomers' prompt tokens that rode in the same target forward

    @property
    def draft_share_s(self) -> float:
        return self.draft_s / max(self.drafting, 1)


def plain_tree(request: Request) -> TokenTree:
    return TokenTree.with_root(request.root_token(), "selected" if request.params.greedy else "sampled")


def draft_trees(requests: list[Request], batch_size: int, failed: dict[Request, BaseException],
                riding: int = 0) -> tuple[dict[Request, TokenTree], dict[Request, int]]:
    """Each request's tree for this step (`riding` prefill tokens share its target forward),
    drafted together (specwood.drafting.together: one draft forward per model a round), and the
    length of the grammar's forced run that starts the tree of each request that has one (its
    nodes 1..k: `commit` tells the drafter only of what it drafted after). A request whose
    drafting raises is put in `failed` and gets no tree."""
    trees: dict[Request, TokenTree] = {}
    forced: dict[Request, int] = {}
    drafts: dict[Request, tuple[Drafting, object]] = {}
    for req in requests:
        try:
            # the grammar's forced run: free candidates, verified, no draft forward; the drafter
            # goes on from its end in the same tree (a feature-level head cannot: it reads the
            # target's features of every path token, so it drafts at the next step)
            processors, newest = req.processors, req.root_token()
            run = forced_run(processors) if processors is not None and req.drafter.shape is not None else []
            chain = forced_tree(newest, run, processors) if run and processors is not None else None
            if chain is not None:
                forced[req] = len(run)
            if chain is not None and wants_features(req):
                trees[req] = chain
                continue
            context, root = (req.context, newest) if chain is None else ([*req.context, newest, *run[:-1]], run[-1])
            # a draft still reading its prompt (after the first token) cannot draft yet: a plain step
            shape = None if req.draft_behind else req.drafter.shape_for_step(batch_size, len(context) + 1, riding,
                                                                              free=len(run))
            if shape is None:
                trees[req] = chain if chain is not None else plain_tree(req)
                continue
            drafting = shape.draft(context, root, req.params, req.draft_generator)
            if chain is not None:
                drafting = drafting_after(drafting, chain)
            if req.processors is not None:  # draft rows processed per node: every child drawn is allowed
                drafting = processed_drafting(drafting, req.processors)
            drafts[req] = (drafting, req.drafter.source)
        except Exception as e:  # noqa: BLE001 - one request's failure must not end the others
            failed[req] = e
            forced.pop(req, None)

    def no_room(req: Request) -> TokenTree:  # a plain tree: no forced run either
        forced.pop(req, None)
        return plain_tree(req)

    drafted, _ = draft_together(drafts, no_room, failed)
    for req, tree in drafted.items():
        trees[req] = tree if req.processors is None else prune_refused(tree, req.processors)
    for req in failed:
        forced.pop(req, None)
    return trees, forced


def target_forward(model: Transformer, cache: KVCache, requests: list[Request],
                   trees: dict[Request, TokenTree]) -> list[torch.Tensor]:
    """One forward over every request's tree: logits [len(tree), V] per request (a draft head's
    source gets the tree's target features)."""
    logits, features = forward_rows_features(model, cache, tree_rows(cache, requests, trees))
    hand_tree_features(requests, features)
    return logits


def wants_features(request: Request) -> bool:
    """Whether the request's draft source reads the target's features (a feature-level draft head)."""
    return request.drafter.wants_target_features


def hand_tree_features(requests: list[Request], features: list[torch.Tensor | None]) -> None:
    for req, f in zip(requests, features):
        if f is not None:
            req.drafter.model_source().take_tree_features(f)


def hand_prompt_features(chunks: list[tuple[Request, int, int]], features: list[torch.Tensor | None]) -> None:
    """The target's features of prefill chunks (request, start, end) to the requests' draft heads."""
    for (req, start, end), f in zip(chunks, features):
        if f is not None:
            req.drafter.model_source().take_prompt_features(start, end, f)


def tree_rows(cache: KVCache, requests: list[Request], trees: dict[Request, TokenTree]) -> list[RowInput]:
    """Each request's tree as a row of a target forward, after its row's cached tokens."""
    return [tree_row(r.cache_row(), trees[r], cache.lengths[r.cache_row()], wants_features(r)) for r in requests]


def tree_row(row: int, tree: TokenTree, L: int, features: bool = False) -> RowInput:
    """A tree's part of a target forward: its nodes in slots L.. after the row's L cached tokens
    (with `features`, every node's target feature too)."""
    n = len(tree)
    # tokens, positions, slots and node indices in one tensor call (each call ~3 us, per request and step)
    tokens, positions, slots, nodes = torch.tensor([tree.tokens, [L + d for d in tree.depths],
                                                    list(range(L, L + n)), list(range(n))])
    return RowInput(row, tokens, positions, slots, tree.attention_mask(L), nodes, nodes if features else None)


def processed(request: Request, tree: TokenTree, logits: torch.Tensor) -> torch.Tensor:
    """The target's logits after the request's per-path processors at every node (specwood.constrain):
    what `ar` samples from at each prefix. Unchanged (no work) for a request without processors."""
    if request.processors is None:
        return logits
    return request.processors.tree_rows(tree, logits)


def verify_requests(requests: list[Request], trees: list[TokenTree], logits: list[torch.Tensor]
                    ) -> list[Verdict | Exception]:
    """Each request's verdict on its tree (or the exception that fails it alone). Greedy trees:
    `verify` one by one (an argmax per node); sampled ones, lone roots included: ONE `verify_trees`
    call for them all, each walking on uniforms drawn from its own request's generator
    (`tree_uniforms`), so a request's tokens are the ones it would draw alone, whatever else
    shares its step. The verifiers see the processed target rows. A shape with `on_root_logits`
    sees the target's processed logits after the context, padding ids masked: what the sampler
    chooses from (auto's late draft)."""
    out: list[Verdict | Exception] = [RuntimeError("not verified") for _ in requests]  # every one is set below
    rows: dict[int, torch.Tensor] = {}  # each request's processed target rows
    sampled: list[tuple[int, torch.Tensor]] = []  # (index, uniforms)
    for i, (req, tree, lg) in enumerate(zip(requests, trees, logits)):
        try:
            rows[i] = lg = processed(req, tree, lg)
            shape = req.drafter.shape
            if shape is not None and shape.watches_root_logits:
                shape.on_root_logits(without_padding(lg[0], req.params))
            if not req.params.greedy:
                sampled.append((i, tree_uniforms(tree, req.target_generator, lg.device)))
            elif len(tree) == 1:
                out[i] = Verdict([], int(next_token(lg[0], req.params, req.target_generator)))
            else:
                out[i] = verify(tree, lg, req.params, req.target_generator)
        except Exception as e:  # noqa: BLE001 - one request's failure must not end the others
            out[i] = e
    if sampled:
        verdicts: list[Verdict | Exception]
        try:
            verdicts = list(verify_trees([trees[i] for i, _ in sampled], [rows[i] for i, _ in sampled],
                                         [requests[i].params for i, _ in sampled], [u for _, u in sampled]))
        except Exception:  # noqa: BLE001 - each alone, on the same draws, to fail only the one at fault
            verdicts = []
            for i, u in sampled:
                try:
                    verdicts.append(verify_trees([trees[i]], [rows[i]], [requests[i].params], [u])[0])
                except Exception as e:  # noqa: BLE001
                    verdicts.append(e)
        for (i, _), v in zip(sampled, verdicts):
            out[i] = v
    for i, (req, tree, v) in enumerate(zip(requests, trees, out)):
        if isinstance(v, Verdict) and req.params.logprobs is not None:
            try:
                req.out.offer_logprobs(path_logprobs(rows[i], [0] + v.accepted, v.tokens(tree), req.params.logprobs))
            except Exception as e:  # noqa: BLE001
                out[i] = e
    return out


def first_tokens(requests: list[Request], logits: list[torch.Tensor]) -> list[int | Exception]:
    """`first_token` of many requests (or the error it raised for one): the sampled ones without
    processors or logprobs share one `target_probs` and one draw per law (`law_key`), each on a
    uniform from its own generator -- the tokens `first_token` gives, computed once for the batch."""
    out: list[int | Exception] = [0] * len(requests)
    shared: dict[tuple[object, ...], list[int]] = {}
    alone = []
    for i, r in enumerate(requests):
        if r.processors is None and r.params.logprobs is None and not r.params.greedy:
            shared.setdefault(law_key(r.params), []).append(i)
        else:
            alone.append(i)
    for members in shared.values():
        if len(members) == 1:
            alone += members
            continue
        try:
            rows = torch.stack([logits[i].reshape(-1) for i in members])
            probs = target_probs(rows, requests[members[0]].params)
            u = torch.cat([torch.rand(1, dtype=torch.float64, generator=requests[i].target_generator,
                                      device=rows.device) for i in members])
            tokens = draw_token(probs, u).tolist()
        except Exception:  # noqa: BLE001 - one by one below: the request at fault fails alone
            alone += members
            continue
        for i, token in zip(members, tokens):
            out[i] = token
    for i in alone:
        try:
            out[i] = first_token(requests[i], logits[i])
        except Exception as e:  # noqa: BLE001 - this request fails alone
            out[i] = e
    return out


def first_token(request: Request, logits: torch.Tensor) -> int:
    """The token after the prompt (from its last prefill row), through the same processors and
    sampler as every later one; the processors commit it."""
    rows = logits.reshape(1, -1)
    if request.processors is not None:
        rows = request.processors.rows(rows, [()])
    token = int(next_token(rows[0], request.params, request.target_generator))
    if request.params.logprobs is not None:
        request.out.offer_logprobs(path_logprobs(rows, [0], [token], request.params.logprobs))
    if request.processors is not None:
        request.processors.commit([token])
    return token


def drafted_part(tree: TokenTree, verdict: Verdict, forced: int = 0) -> tuple[TokenTree, Verdict] | None:
    """What the drafter proposed this step and what of it was accepted: the whole tree, or where
    it grew from the end of the grammar's forced run (its first `forced` nodes), the subtree after
    the run (None where the target left the run early, so the draft went untested, or where
    nothing was drafted after it). The stats and `auto` learn from this part only: a forced run
    is no draft."""
    if not forced:
        return tree, verdict
    k = forced
    if len(tree) == k + 1 or len(verdict.accepted) < k:
        return None
    return tree.reroot(k), Verdict([a - k for a in verdict.accepted[k:]], verdict.next_token)


def commit(cache: KVCache, request: Request, tree: TokenTree, verdict: Verdict, cost: StepRecord,
           forced: int = 0) -> list[int]:
    """Keep the accepted path in the request's cache row and draft source; the emitted tokens.
    `forced`: the tree starts with a grammar's forced run of that many nodes (draft_trees)."""
    row = request.cache_row()
    L = cache.lengths[row]
    cache.compact([L + i for i in [0] + verdict.accepted], L, row)
    return advance(request, tree, verdict, cost, forced)


def advance(request: Request, tree: TokenTree, verdict: Verdict, cost: StepRecord, forced: int = 0) -> list[int]:
    """The target's cache already holds the accepted path: move the draft source, stats, drafter
    and context on by the verdict; the emitted tokens. `forced`: as for `commit`."""
    path = [0] + verdict.accepted
    if request.drafter.source is not None:
        request.drafter.source.commit(tree, verdict.accepted, verdict.next_token)
    drafted = drafted_part(tree, verdict, forced)
    if drafted is not None:
        sub, sub_verdict = drafted
        if len(sub) > 1 or request.drafter.shape is not None:
            request.stats.record(sub, len(sub_verdict.accepted), cost.draft_s, cost.verify_s)
        request.drafter.on_step(sub, sub_verdict, cost)
    request.context.extend(tree.tokens[i] for i in path)
    request.root = verdict.next_token
    emitted = [tree.tokens[i] for i in verdict.accepted] + [verdict.next_token]
    if request.processors is not None:
        request.processors.commit(emitted)
    return emitted
