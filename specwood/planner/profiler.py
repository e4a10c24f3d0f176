"""Measuring T_v(x, ctx) and T_d(x, ctx) on the device the engine runs on.

Conventions used throughout the planner:
* x is the *verification length*: the number of tokens in one target forward, i.e. the tree's
  nodes including the root (the newest accepted token). x = 1 is autoregressive decoding.
* A tree of x tokens has x - 1 drafted nodes, which is what shapes call `budget`.

Timings are medians over `repeats` runs after a warm-up, under `torch.inference_mode`; a run
that a pause overlapped (the server stops its background planner while requests run) is taken
again (specwood.planner.pauses).
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch

from specwood.engine.protocols import EngineLike
from specwood.models.cache import KVCache
from specwood.models.transformer import MoEFeedForward, Transformer
from specwood.planner.pauses import undisturbed
from specwood.sampling import SamplingParams
from specwood.tree.token_tree import TokenTree

if TYPE_CHECKING:
    from tqdm import tqdm

# dense at small x: on a CPU T_v(x) already rises between 2 and 8 tokens, and P_eff(x) is flat
# enough there that interpolating over a gap of 4 picks the wrong neighbour
DEFAULT_XS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64, 96, 128)
QUICK_XS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
DEFAULT_CONTEXTS: tuple[int, ...] = (128, 512, 2048)
QUICK_CONTEXTS: tuple[int, ...] = (128, 512)

TimeTable = dict[int, dict[int, float]]  # ctx -> x -> seconds
ShapeFactory = Callable[[int], Any]  # budget (drafted nodes) -> TreeShape


def _progress(total: int, desc: str, enabled: bool) -> tqdm[Any]:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True, disable=not enabled)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1, device: torch.device | None = None) -> float:
    """Median wall time of `fn()` in seconds (synchronising CUDA around each call)."""
    dev = device or torch.device("cpu")
    for _ in range(warmup):
        fn()
    _sync(dev)
    samples = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def random_tree(x: int, generator: torch.Generator, vocab: int, mask: str = "tree") -> TokenTree:
    """A tree of x tokens: random recursive tree (each node's parent uniform among earlier
    nodes, depth ~ ln x like real drafted trees) or a chain. Tokens are random ids."""
    tokens = torch.randint(0, vocab, (x,), generator=generator).tolist()
    tree = TokenTree.with_root(tokens[0])
    for i in range(1, x):
        parent = i - 1 if mask == "chain" else int(torch.randint(0, i, (1,), generator=generator))
        tree.add_node(parent, tokens[i])
    return tree


def bend_points(times: Mapping[int, float], threshold: float = 0.35, max_new: int = 4) -> list[int]:
    """Extra x values where the throughput curve P(x) = x / T(x) bends sharply, best first.

    On log-log axes a roofline has slope 1 below the ridge and 0 above. A segment between two
    measured x whose slope differs from a neighbouring segment's by more than `threshold` gets
    its geometric midpoint (an integer not measured yet). Segments whose slope lies *between*
    both neighbours' come first: the ridge is inside them.
    """
    xs = sorted(x for x in times if times[x] > 0)
    if len(xs) < 3:
        return []
    logp = [math.log(x / times[x]) for x in xs]
    slopes = [(logp[i + 1] - logp[i]) / math.log(xs[i + 1] / xs[i]) for i in range(len(xs) - 1)]
    ranked = []
    for i, s in enumerate(slopes):
        diffs = [abs(s - slopes[j]) for j in (i - 1, i + 1) if 0 <= j < len(slopes)]
        mid = int(round(math.sqrt(xs[i] * xs[i + 1])))
        if max(diffs) > threshold and xs[i] < mid < xs[i + 1] and mid not in times:
            inside = min(diffs) if len(diffs) == 2 else 0.0
            ranked.append((-inside, -max(diffs), mid))
    return [mid for *_, mid in sorted(ranked)][:max_new]


def _verify_callable(model: Transformer, cache: KVCache, ctx: int, tree: TokenTree) -> Callable[[], Any]:
    """One target forward over the tree after `ctx` cached tokens, plus the argmax the greedy
    verifier does (part of the step's cost)."""
    dev = model.device
    tokens = torch.tensor([tree.tokens], device=dev)
    positions = tree.positions(ctx).to(dev)
    mask = tree.attention_mask(ctx).to(dev)
    slots = torch.arange(ctx, ctx + len(tree), device=dev)

    def run() -> Any:
        return model(tokens, positions, mask, cache, slots)[0].argmax(-1)

    return run


def measure_verify_times(
    model: Transformer,
    xs: Sequence[int] = DEFAULT_XS,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    repeats: int = 5,
    quick: bool = False,
    *,
    mask: str = "tree",
    refine: bool = True,
    seed: int = 0,
    progress: bool = True,
) -> TimeTable:
    """T_v(x, ctx): median seconds of one target forward over x tree tokens after ctx cached ones.

    The KV cache is filled with random values up to ctx (attention cost does not depend on the
    values, and this avoids a prefill per bucket). The forward includes the greedy argmax but not
    building the mask. With `refine`, up to 4 extra x points (2 when `quick`) are measured where
    P(x) bends (see `bend_points`); `quick` also caps repeats at 5. x = 1 is timed with twice the
    repeats. Contexts that do not fit the model's positions are skipped.
    Returns {ctx: {x: seconds}}.
    """
    if mask not in ("tree", "chain"):
        raise ValueError(f"mask must be 'tree' or 'chain', got {mask!r}")
    if quick:
        repeats = min(repeats, 5)
    xs = sorted({int(x) for x in xs if int(x) >= 1})
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    table: TimeTable = {}
    usable = [c for c in contexts if c + max(xs) < model.max_positions]
    skipped = [c for c in contexts if c not in usable]
    if skipped and progress:
        print(f"[profiler] skipping contexts {skipped}: beyond the model's {model.max_positions} positions",
              file=sys.stderr)
    with torch.inference_mode(), _progress(len(usable) * len(xs), "profiling T_v(x)", progress) as bar:
        for ctx in usable:
            cache = model.new_cache(ctx + max(xs) + 1)  # refined x stay below max(xs)
            cache.k.normal_()
            cache.v.normal_()
            cache.length = ctx
            row: dict[int, float] = {}
            # warm up allocator, thread pool and kernels once, at both ends of the range
            for x in (max(xs), 1) if ctx == usable[0] else (1,):
                _verify_callable(model, cache, ctx, random_tree(x, gen, vocab, mask))()

            def measure(batch: list[int]) -> None:
                # round-robin over x, `repeats` rounds: a slow spell of a shared machine (memory
                # bandwidth taken by a neighbour) then hits every x alike instead of bending the
                # curve at whichever x it happened to fall on
                fns = {x: _verify_callable(model, cache, ctx, random_tree(x, gen, vocab, mask)) for x in batch}
                samples: dict[int, list[float]] = {x: [] for x in batch}
                for fn in fns.values():  # first call of a new shape
                    fn()
                def one_round() -> dict[int, list[float]]:
                    # P(1) = P_AR is the reference of every decision: time it twice as often
                    return {x: [median_time(fn, 1, warmup=0, device=model.device) for _ in range(2 if x == 1 else 1)]
                            for x, fn in fns.items()}

                for _ in range(repeats):
                    for x, taken in undisturbed(one_round).items():  # a round a pause spoilt is taken again
                        samples[x] += taken
                for x in batch:
                    row[x] = statistics.median(samples[x])
                    bar.set_postfix(ctx=ctx, x=x, ms=f"{row[x] * 1e3:.1f}")
                    bar.update(1)

            measure(list(xs))
            if refine:
                extra = bend_points(row, max_new=2 if quick else 4)
                bar.total = (bar.total or 0) + len(extra)
                if extra:
                    measure(extra)
            table[ctx] = dict(sorted(row.items()))
    return table


def measure_expert_union(model: Transformer, xs: Sequence[int], ctx: int, trees: int = 4, seed: int = 1,
                         mask: str = "tree") -> dict[int, float]:
    """A MoE target's routing on verify trees: per x, the mean number of distinct experts one layer's
    x rows route to, over every layer and `trees` random trees of x tokens after ctx cached tokens
    (set up as measure_verify_times sets them up). The analytic model's `woken`
    (devices.union_curve), where it would otherwise take the uniform-routing bound."""
    cfg = model.config
    counts: list[int] = []

    def routed(module: MoEFeedForward, args: tuple[torch.Tensor, ...]) -> None:  # the layer's own routing
        counts.append(len(torch.unique(module.route(args[0].reshape(-1, args[0].shape[-1]))[1])))

    hooks = [block.feed_forward.register_forward_pre_hook(routed) for block in model.layers
             if isinstance(block.feed_forward, MoEFeedForward)]
    gen = torch.Generator().manual_seed(seed)
    union: dict[int, float] = {}
    try:
        with torch.inference_mode():
            cache = model.new_cache(ctx + max(xs) + 1)
            cache.k.normal_(generator=gen)
            cache.v.normal_(generator=gen)
            cache.length = ctx
            for x in xs:
                counts.clear()
                for _ in range(trees):
                    _verify_callable(model, cache, ctx, random_tree(x, gen, cfg.vocab_size, mask))()
                union[x] = statistics.mean(counts)
    finally:
        for hook in hooks:
            hook.remove()
    return union


# ---------------------------------------------------------------------------------------------
# draft cost


def context_tokens(seed_ids: Sequence[int], ctx: int, vocab: int) -> list[int]:
    """A natural-looking context of exactly ctx tokens: the seed text repeated (drafting cost
    depends on how peaked the draft's distributions are, so random ids would mislead dyspec)."""
    base = [t for t in seed_ids if 0 <= t < vocab] or list(range(min(vocab, 100)))
    reps = ctx // len(base) + 1
    return (base * reps)[:ctx]


def method_components(engine: EngineLike, shape: str | ShapeFactory, budget: int) -> tuple[Any, Any]:
    """(source, shape) for a method name (through the method registry) or a shape factory, with a
    draft source that keeps a cache of its own (reused across builds and requests)."""
    from specwood.drafting.model_source import ModelDraftSource

    from specwood.models.transformer import Transformer

    def own_source(model: Any) -> Any:  # a draft on another backend (llama.cpp) makes its own sources
        return ModelDraftSource(model) if isinstance(model, Transformer) else model.new_source()

    if callable(shape):
        return own_source(engine.draft_model) if engine.draft_model is not None else None, shape(budget)
    from specwood.methods import prepare_method

    drafter = prepare_method(engine, shape, {"budget": budget})(own_source, 0, 0)
    return drafter.source, drafter.shape


def measure_draft_times(
    engine: EngineLike,
    shapes: Iterable[str] | Mapping[str, ShapeFactory],
    xs: Sequence[int] = QUICK_XS,
    contexts: Sequence[int] = (128,),
    repeats: int = 3,
    *,
    seed_ids: Sequence[int] | None = None,
    progress: bool = True,
) -> dict[str, TimeTable]:
    """T_d(x, ctx): median seconds to draft a tree of x tokens (budget x - 1) with each shape.

    `shapes` is a list of method names (composed like `generate(method=...)`, e.g. "dyspec",
    "chain", "early-exit") or {name: factory(budget) -> TreeShape} drafting with the engine's
    draft model. The source is started once per (shape, context) on `ctx` tokens of natural
    text (`seed_ids`, repeated), then every build is timed and committed with nothing accepted,
    which is what a fully rejected step costs the source. T_d(1) = 0 (no drafting).
    Returns {name: {ctx: {x: seconds}}}.
    """
    items = list(shapes.items()) if isinstance(shapes, Mapping) else [(s, s) for s in shapes]
    xs = sorted({int(x) for x in xs if int(x) >= 1})
    params = SamplingParams()
    vocab = engine.target_config.vocab_size
    seed = list(seed_ids) if seed_ids else _default_seed_ids(engine)
    out: dict[str, TimeTable] = {}
    # every timed build commits one token, so the draft's context grows a little while we measure
    growth = max(xs) + (repeats + 2) * len(xs) + 2
    limit = engine.max_context
    usable = [c for c in contexts if c + growth < limit]
    if not usable and limit - growth > 8:  # a small model: the largest context that fits
        usable = [limit - growth - 1]
    total = len(items) * len(usable) * len(xs)
    with torch.inference_mode(), _progress(total, "profiling T_d(x)", progress) as bar:
        for name, spec in items:
            out[name] = {}
            for ctx in usable:
                ids = context_tokens(seed, ctx, vocab)
                prompt, root = ids[:-1], ids[-1]
                source = None
                row: dict[int, float] = {}
                for x in xs:
                    if x == 1:
                        row[x] = 0.0
                        bar.update(1)
                        continue
                    src, shape = method_components(engine, spec, x - 1)
                    if source is None:
                        source = src
                        if source is not None:
                            source.start(prompt, (repeats + 2) * len(xs) + 8)

                    def draft_once() -> None:
                        tree = shape.build(prompt, root, source, params, None)
                        if source is not None:
                            source.commit(tree, [], root)

                    row[x] = median_time(draft_once, repeats, warmup=1, device=engine.device)
                    bar.set_postfix(shape=name, ctx=ctx, x=x, ms=f"{row[x] * 1e3:.1f}")
                    bar.update(1)
                out[name][ctx] = row
    return out


def _default_seed_ids(engine: EngineLike) -> list[int]:
    from specwood.planner.calibration import CALIBRATION_PROMPTS

    text = "\n\n".join(CALIBRATION_PROMPTS)
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------------------------------------
# running SD on a calibration set (AAT, prior scores)


def run_speculative(engine: EngineLike, source: Any, shape: Any, prompts_ids: Sequence[Sequence[int]], max_tokens: int,
                    stats: Any | None = None, hooks: Sequence[Callable[[Any, Any], None]] = ()) -> Any:
    """Greedy SD over every prompt with the engine's own decoding step (a batch of one each);
    returns the SpecStats accumulated over all of them (its mean_accepted_tokens is the AAT,
    bonus token included). `hooks(tree, verdict)` see every step."""
    from specwood.engine.request import Drafter, SpecStats

    stats = stats if stats is not None else SpecStats()
    for ids in prompts_ids:
        room = engine.max_context - len(ids) - 1
        if room < 2:
            continue
        limit = min(max_tokens, room)
        drafter = Drafter(source, shape, list(hooks))
        request = engine.new_request(list(ids), max_tokens=limit, prepared=lambda *_: drafter)
        request.stats = stats
        engine.run(request)
    return stats
