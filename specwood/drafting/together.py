"""Many requests' drafting advanced together: the one drafting loop of the batched step
(specwood.engine.step) and of DuoDecoding's draft worker (specwood.engine.parallel_worker).

Each request's tree shape is a coroutine (specwood.drafting.base.Drafting) that yields the calls
it needs answered -- a tree and the nodes whose draft logits it wants -- and returns its tree.
Every round, the calls of all requests whose sources are draft-model rows go through one forward
per model (forward_draft_calls); any other source answers its own call.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar

from specwood.drafting.base import Drafting
from specwood.drafting.model_source import forward_draft_calls
from specwood.errors import ContextLengthError, SpecwoodError
from specwood.tree.token_tree import TokenTree

K = TypeVar("K", bound=Hashable)


def draft_together(drafts: dict[K, tuple[Drafting, Any]], no_room: Callable[[K], TokenTree],
                   failed: dict[K, BaseException] | None = None) -> tuple[dict[K, TokenTree], int]:
    """Run every (drafting coroutine, draft source) of `drafts` to its tree; the trees and the
    number of rounds. A request whose source runs out of context gets `no_room(key)`. One that
    raises goes into `failed` and gets no tree; with `failed` None the error propagates."""
    trees: dict[K, TokenTree] = {}
    active: dict[K, tuple[Drafting, Any, Any]] = {}

    def fail(key: K, error: BaseException) -> None:
        if failed is None:
            raise error
        failed[key] = error

    for key, (drafting, source) in drafts.items():
        try:
            active[key] = (drafting, source, next(drafting))
        except StopIteration as done:
            trees[key] = done.value
        except Exception as e:  # noqa: BLE001 - one request's failure must not end the others
            fail(key, e)
    rounds = 0
    while active:
        rounds += 1
        batched = [k for k, (_, source, _) in active.items() if source is not None and source.batched]
        answers: dict[K, Any] = {}
        if batched:
            try:
                answers.update(zip(batched, forward_draft_calls([(active[k][1], *active[k][2]) for k in batched])))
            except Exception:  # noqa: BLE001 - answered one by one below: finds the request at fault
                answers.clear()
        for key in list(active):
            drafting, source, call = active[key]
            try:
                if key not in answers:
                    if source is None:
                        raise SpecwoodError("a tree shape asked for draft logits but its request has no draft source")
                    answers[key] = source.logits(*call)
                active[key] = (drafting, source, drafting.send(answers[key]))
            except StopIteration as done:
                trees[key] = done.value
                del active[key]
            except ContextLengthError:  # no room left to draft: a tree of the root alone
                del active[key]
                drafting.close()
                trees[key] = no_room(key)
            except Exception as e:  # noqa: BLE001
                del active[key]
                drafting.close()
                fail(key, e)
    return trees, rounds
