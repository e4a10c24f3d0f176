"""DuoDecoding's draft worker: the draft process's state and its handling of every message of the
protocol (specwood.engine.parallel's docstring), the tree payloads that cross the pipe, and the
process's entry point. `DraftWorker` also runs in-process (`_Inline`) for tests.
"""
from __future__ import annotations

import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specwood.drafting.multi_sequence import MultiSequenceShape, sequence_end
from specwood.drafting.together import draft_together
from specwood.errors import SpecwoodError
from specwood.models.cache import KVCache
from specwood.tree.token_tree import TokenTree


@dataclass
class _WorkerRequest:
    source: Any  # ModelDraftSource on the worker's pool
    params: Any
    generator: torch.Generator | None
    max_sequences: int
    seq: list[int]  # every token before `root` (cache row + pending tokens)
    root: int
    tree: TokenTree | None = None


class DraftWorker:
    """The draft process's state: a KV pool with one row per request, each request's drafting
    state, and the handling of every message of the protocol."""

    def __init__(self, model: Any):
        self.model = model
        self.pool: KVCache | None = None
        self.reqs: dict[str, _WorkerRequest] = {}

    # --- messages ---

    def handle(self, msg: tuple[Any, ...], idle_s: float = 0.0) -> tuple[Any, ...]:
        kind = msg[0]
        if kind == "calibrate":
            return ("calibrated", time_forward(self.model, msg[1], msg[2]))
        t0 = time.perf_counter()
        prefill_s = 0.0
        if kind == "prefill":
            _, drops, rows, row_len, entries = msg
            self._drop(drops)
            self._admit(entries, rows, row_len)
            prefill_s = time.perf_counter() - t0
            budgets = {e[0]: (e[4], e[5], e[6]) for e in entries}
        elif kind == "go":
            _, drops, entries = msg
            self._drop(drops)
            budgets = {}
            for rid, ctx_len, root, hit, gamma, depth, catchup in entries:
                self._apply(rid, ctx_len, root, hit, catchup)
                budgets[rid] = (gamma, depth, self.reqs[rid].max_sequences)
        else:
            raise RuntimeError(f"unknown message {kind!r}")
        trees, rounds = self._draft(budgets)
        payloads = {rid: tree_payload(tree) for rid, tree in trees.items()}
        timing = {"idle_s": idle_s, "busy_s": time.perf_counter() - t0, "prefill_s": prefill_s, "rounds": rounds,
                  "tokens": sum(t.size for t in trees.values())}
        return ("drafts", payloads, timing)

    def _drop(self, rids: list[str]) -> None:
        for rid in rids:
            w = self.reqs.pop(rid, None)
            if w is not None:
                w.source.close()

    def _admit(self, entries: list[tuple[Any, ...]], rows: int, row_len: int) -> None:
        from specwood.drafting.model_source import ModelDraftSource
        from specwood.models.prefill import PREFILL_CHUNK, prefill_rows

        need_rows = len(self.reqs) + len(entries)
        if self.pool is None or self.pool.rows < need_rows or self.pool.max_len < row_len:
            if self.reqs:
                raise RuntimeError("the draft pool cannot grow while requests are running")
            self.pool = self.model.new_cache(-(-row_len // 256) * 256, max(rows, need_rows))
        pool = self.pool
        new = []
        for rid, prompt, params, seed, _gamma, _depth, max_seqs in entries:
            src = ModelDraftSource(self.model, extra_slots=0, pool=pool)
            src.attach(0, 0)
            gen = None
            if seed is not None:
                gen = torch.Generator(device=self.model.device)
                gen.manual_seed(seed)
            w = _WorkerRequest(src, params, gen, max_seqs, list(prompt[:-1]), int(prompt[-1]))
            self.reqs[rid] = w
            new.append(w)
        start = 0
        with torch.inference_mode():  # the prompt but its last token, which roots the first tree
            while True:
                chunks = [(w.source.kv_row()[1], w.seq, start, min(start + PREFILL_CHUNK, len(w.seq)))
                          for w in new if len(w.seq) > start]
                if not chunks:
                    break
                prefill_rows(self.model, pool, chunks)
                start += PREFILL_CHUNK

    def _apply(self, rid: str, ctx_len: int, root: int, hit: int, catchup: list[int]) -> None:
        """The target's verdict on the last iteration: keep the guessed sequence `hit` (its chain
        becomes the speculative prefix the next tree grows from), or roll back to `ctx_len`.
        `catchup`: context tokens the target committed that this side never saw (decoded while
        the draft prefilled), appended before the rollback."""
        w = self.reqs[rid]
        src, tree = w.source, w.tree
        if hit >= 0:
            if tree is None or tree.parents[hit] != 0 or tree.tokens[hit] != root:
                raise RuntimeError(f"protocol: node {hit} is not a first-level guess of token {root}")
            end = sequence_end(tree, hit)
            path = tree.path_to(end)
            src.commit(tree, path[1:-1], tree.tokens[end])  # processed path kept in place, no re-prefill
            w.seq += [tree.tokens[i] for i in path[:-1]]
            w.root = tree.tokens[end]
            if len(w.seq) != ctx_len + tree.depths[end] - 1:
                raise RuntimeError(f"protocol: draft at {len(w.seq)} tokens, target context {ctx_len}")
        else:
            full = w.seq + [w.root] + list(catchup)
            if ctx_len > len(full):
                raise RuntimeError(f"protocol: target context {ctx_len} is ahead of the draft's {len(full)}")
            L, row = src.length, src.row
            if ctx_len <= L:  # rejected inside the committed speculative prefix: truncate
                src.cache.lengths[row] = ctx_len
                src.pending = []
            elif not src.pending and src.slot_of.get(0) == L and ctx_len == L + 1:
                src.cache.lengths[row] = L + 1  # the last tree's root was processed in place
            else:  # tokens the draft never processed (a lone-root tree): feed them next forward
                src.pending = full[L:ctx_len]
            src.slot_of, src.node_logits, src.seen = {}, {}, None
            w.seq, w.root = full[:ctx_len], int(root)
        w.tree = None
        if len(w.seq) != src.length + len(src.pending):
            raise RuntimeError("protocol: draft cache row out of step with its tokens")

    def _draft(self, budgets: dict[str, tuple[int, int | None, int]]) -> tuple[dict[str, TokenTree], int]:
        """Every request's next tree, drafted together (one forward per round for all of them)."""
        drafts = {}
        for rid, (gamma, depth, max_seqs) in budgets.items():
            w = self.reqs[rid]
            shape = MultiSequenceShape(budget=gamma, max_sequences=max_seqs, max_depth=depth)
            drafts[rid] = (shape.draft(w.seq, w.root, w.params, w.generator), w.source)

        def root_alone(rid: str) -> TokenTree:  # a request without room to draft
            w = self.reqs[rid]
            return TokenTree.with_root(w.root, "selected" if w.params.greedy else "sampled")

        with torch.inference_mode():
            trees, rounds = draft_together(drafts, root_alone)
        for rid, tree in trees.items():
            self.reqs[rid].tree = tree
        return trees, rounds


def tree_payload(tree: TokenTree) -> tuple[Any, ...]:
    """What crosses the pipe for a drafted tree: ids, parents, draft probs, and (sampling only)
    the q rows of drafted nodes that have a drafted child."""
    nodes = sorted(tree.child_dists)
    dists = np.stack([tree.child_dists[n].float().cpu().numpy() for n in nodes]) if nodes else None
    return (tree.tokens, tree.parents, tree.probs, nodes, dists)


def tree_from_payload(payload: tuple[Any, ...], greedy: bool, device: torch.device | str = "cpu") -> TokenTree:
    tokens, parents, probs, nodes, dists = payload
    depths = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depths[i] = depths[parents[i]] + 1
    tree = TokenTree(list(tokens), list(parents), depths, list(probs), {}, "selected" if greedy else "sampled")
    if dists is not None:
        rows = torch.from_numpy(dists).to(device)  # beside the target's logits (the verifier mixes them)
        tree.child_dists = {n: rows[k] for k, n in enumerate(nodes)}
    return tree


def time_forward(model: Any, ctx: int, reps: int) -> float:
    """Median seconds of a one-token forward at context `ctx` (a scratch cache; contents unused)."""
    ctx = max(1, min(ctx, model.max_positions - 1))
    cache = model.new_cache(ctx + 1, 1)
    dev = model.device
    tokens = torch.zeros(1, 1, dtype=torch.long, device=dev)
    pos = torch.tensor([ctx], device=dev)
    mask = torch.ones(1, ctx + 1, dtype=torch.bool, device=dev)
    slots = torch.tensor([ctx], device=dev)
    times = []
    with torch.inference_mode():
        for i in range(reps + 1):
            t0 = time.perf_counter()
            model(tokens, pos, mask, cache, slots).sum().item()  # .item(): wait for the device
            if i:  # the first one warms up
                times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _pin(threads: int) -> list[int] | None:
    """Pin this process to the last `threads` of its allowed cores (None where not allowed)."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
        cores = allowed[-threads:] if threads <= len(allowed) else allowed
        os.sched_setaffinity(0, cores)
        return cores
    except (AttributeError, OSError):
        return None


def _worker_main(conn: Any) -> None:
    """The draft process: build the draft model from the shipped weights, then serve messages."""
    from specwood.engine.processes import exit_with_parent
    from specwood.heap import freeze_loaded_objects

    exit_with_parent()  # never outlives the server or the CLI that started it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    try:
        _, spec = conn.recv()
        cores = _pin(spec["threads"])
        torch.set_num_threads(spec["threads"])
        model = build_draft(spec)
        del spec
        worker = DraftWorker(model)
        freeze_loaded_objects()  # steps for as long as it lives: no full collections over its imports
        conn.send(("ready", {"pid": os.getpid(), "device": str(model.device), "threads": torch.get_num_threads(),
                             "cores": cores, "vocab_size": model.config.vocab_size, "dtype": str(model.dtype),
                             "int4": any(type(m).__name__ == "Int4Linear" for m in model.modules())}))
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"the draft worker could not start: {type(e).__name__}: {e}"))
        return
    last = time.perf_counter()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the main process is gone
        idle = time.perf_counter() - last
        if msg[0] == "stop":
            return
        try:
            reply = worker.handle(msg, idle)
        except Exception as e:  # noqa: BLE001
            reply = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
        conn.send(reply)
        last = time.perf_counter()


def draft_spec(model: Any, device: str, threads: int, draft_dtype: str | None = None) -> dict[str, Any]:
    """The draft model as the worker rebuilds it: config and weights (copied once into shared
    memory by the pipe's pickler, so the worker maps them instead of copying them again).

    draft_dtype None keeps the loaded draft's form; "auto" is int4 weights on a CPU draft device
    (as `specwood.load` does for CPU drafts) and the loaded dtype elsewhere; "int4", "bf16" and
    "fp32" force one (int4 only on a CPU)."""
    from specwood.models.linears import int4_available

    dtype = model.dtype
    int4 = any(type(m).__name__ == "Int4Linear" for m in model.modules())
    on_cpu = torch.device(device).type == "cpu"
    if draft_dtype == "auto":
        int4 = on_cpu and int4_available()
    elif draft_dtype == "int4":
        if not (on_cpu and int4_available()):
            raise SpecwoodError("--draft-dtype int4 needs a CPU draft device with torch's int4 kernel")
        int4 = True
    elif draft_dtype in ("bf16", "fp32"):
        int4, dtype = False, torch.bfloat16 if draft_dtype == "bf16" else torch.float32
    elif draft_dtype is not None:
        raise SpecwoodError(f"unknown draft dtype '{draft_dtype}' (use auto, int4, bf16 or fp32)")
    if int4:
        dtype = torch.bfloat16
    weights = {k: v.detach().to("cpu", dtype).clone() for k, v in model.canonical_state_dict().items()}
    return {"config": model.config, "weights": weights, "dtype": dtype, "int4": int4 and on_cpu,
            "max_positions": model.max_positions, "device": device, "threads": threads}


def build_draft(spec: dict[str, Any]) -> Any:
    from specwood.models.transformer import build_model

    dev = torch.device(spec["device"])
    int4 = spec["int4"] and dev.type == "cpu"
    return build_model(spec["config"], spec["weights"], spec["dtype"], dev, max_positions=spec["max_positions"],
                       int4=int4)
