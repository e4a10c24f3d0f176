"""The plug-in contracts (docs/engine.md, "Plug-in contracts"): the engine calls only what the base
classes declare, and never probes a plug-in for attributes.

Plug-ins are draft sources (specwood.drafting.base.DraftSource), tree shapes and shape policies
(TreeShape, ShapePolicy), the logits processors (specwood.constrain.processors.Processors) and
executors (specwood.engine.executor.Executor). These tests read the engine's source with `ast`:
no `hasattr`/`getattr` on anything but the few objects allowed below (each with its reason), no
`isinstance`/`type(...) is` on a plug-in class, and every attribute the engine reads off a
request's source, shape or processors, or off an executor, is declared by its base class.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import pkgutil
import re

import pytest

import specwood
from specwood.constrain.processors import Processors
from specwood.drafting.base import DraftSource, ShapePolicy, TreeShape
from specwood.engine.executor import Executor
from specwood.sampling import SamplingParams

ROOT = pathlib.Path(specwood.__file__).parent
ENGINE_FILES = sorted((ROOT / "engine").rglob("*.py"))
DRAFT_LOOP = ROOT / "drafting" / "together.py"  # the engine's drafting loop, outside engine/

# an expression that names a plug-in: a request's source, shape, drafter or processors, or an executor
PLUGIN = re.compile(r"(^|\.|_)(source|src|shape|drafter|processors|proc|executor)$")

# (file under specwood/engine, the object probed) -> why a getattr/hasattr on it is no plug-in probe
ALLOWED_PROBES: dict[tuple[str, str], str] = {
    ("api.py", "self.target"): "the target model: a torch Transformer or a llama.cpp target (models/)",
    ("api.py", "self.draft_model"): "the draft model: a torch Transformer or a llama.cpp draft (models/)",
    ("api.py", "tok"): "a Hugging Face tokenizer (third-party)",
    ("chat.py", "tokenizer"): "a Hugging Face tokenizer (third-party)",
    ("chat.py", "backend"): "the tokenizers library's backend tokenizer (third-party)",
    ("chat.py", "t"): "a tokenizer's added-token record (third-party)",
    ("args.py", "args"): "an argparse namespace: commands add different flags",
    ("parallel_args.py", "args"): "an argparse namespace: commands add different flags",
    ("specpipe/args.py", "args"): "an argparse namespace: commands add different flags",
    ("specpipe/comm.py", "dist"): "torch.distributed: DistError is missing from older torch",
    ("specpipe/launch.py", "self.engine"): "an Engine or a test's stand-in engine",
    ("sequential.py", "model"): "a draft model (models/, not a plug-in base here) may name the source class its "
                                "rows need (DraftHead.source_class); Transformer could declare the default",
}

# (file under specwood/engine, plug-in class) -> why an isinstance on it is no capability probe
ALLOWED_ISINSTANCE: dict[tuple[str, str], str] = {
    ("executor.py", "Executor"): "executor=... is a name or an executor object",
    ("executors.py", "ParallelExecutor"): "executor=... is a name or a ParallelExecutor object",
    ("specpipe/launch.py", "PipelineExecutor"): "executor=... is a name or a PipelineExecutor object",
}


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT / "engine").as_posix() if path.is_relative_to(ROOT / "engine") else path.name


def _calls(path: pathlib.Path, names: tuple[str, ...]):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names and node.args:
            yield node


def _import_all() -> None:
    """Import every module of specwood that defines plug-ins (optional backends may be missing)."""
    for package in ("specwood.drafting", "specwood.planner", "specwood.engine", "specwood.constrain"):
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, package + "."):
            try:
                importlib.import_module(info.name)
            except ImportError:
                pass


def _subclasses(cls: type) -> set[type]:
    out, todo = set(), [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


def _plugin_classes() -> set[type]:
    _import_all()
    bases = {DraftSource, ShapePolicy, Executor, Processors}
    return {c for b in bases for c in {b} | _subclasses(b) if c.__module__.startswith("specwood.")}


# ---------------------------------------------------------------------------------------------
# no probing


@pytest.mark.parametrize("path", [*ENGINE_FILES, DRAFT_LOOP], ids=lambda p: _rel(p))
def test_the_engine_probes_no_plugin_for_attributes(path):
    bad = []
    for call in _calls(path, ("hasattr", "getattr")):
        obj = ast.unparse(call.args[0])
        key = (_rel(path), obj)
        if key in ALLOWED_PROBES:
            continue
        what = "a plug-in" if PLUGIN.search(obj) else "an object not on the allow-list"
        bad.append(f"{_rel(path)}:{call.lineno}: {call.func.id}({obj}, ...) probes {what}")
    assert not bad, ("declare the attribute on the plug-in's base class (specwood.drafting.base, "
                     "specwood.engine.executor) instead, or allow-list a non-plug-in object with its reason:\n"
                     + "\n".join(bad))


@pytest.mark.parametrize("path", [*ENGINE_FILES, DRAFT_LOOP], ids=lambda p: _rel(p))
def test_the_engine_asks_no_plugin_its_class(path):
    names = {c.__name__ for c in _plugin_classes()}
    bad = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        classes: list[str] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
            arg = node.args[1]
            parts = arg.elts if isinstance(arg, ast.Tuple) else [arg]
            classes = [ast.unparse(p).rpartition(".")[2] for p in parts]
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) \
                and isinstance(node.left.func, ast.Name) and node.left.func.id == "type":
            classes = [ast.unparse(c).rpartition(".")[2] for c in node.comparators]
        for name in classes:
            if name in names and (_rel(path), name) not in ALLOWED_ISINSTANCE:
                bad.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "ask the plug-in through a declared flag or method, not its class:\n" + "\n".join(bad)


def test_the_allow_lists_name_no_plugin():
    plugins = [key for key in ALLOWED_PROBES if PLUGIN.search(key[1])]
    assert plugins == []
    assert all(reason.strip() for reason in [*ALLOWED_PROBES.values(), *ALLOWED_ISINSTANCE.values()])


def test_the_scheduler_forwards_nothing_and_takes_an_executor():
    """What an executor holds is read off `scheduler.executor`, never through the scheduler."""
    import inspect as _inspect

    from specwood.engine.scheduler import Scheduler

    assert "__getattr__" not in vars(Scheduler)
    assert list(_inspect.signature(Scheduler).parameters) == ["executor", "config"]


# ---------------------------------------------------------------------------------------------
# what the engine calls is declared


def _attributes_read(path: pathlib.Path, on: re.Pattern) -> set[tuple[str, int]]:
    """The attributes the file reads or calls on expressions matching `on`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and on.search(ast.unparse(node.value)):
            out.add((node.attr, node.lineno))
    return out


def _declared(cls: type, attr: str) -> bool:
    return any(attr in vars(c) or attr in getattr(c, "__annotations__", {}) for c in cls.__mro__)


def test_what_the_engine_calls_on_a_source_or_a_shape_is_declared():
    on_source = re.compile(r"(drafter\.source|^src|^source)$")
    on_shape = re.compile(r"(drafter\.shape|^shape)$")
    bad = []
    for path in [*ENGINE_FILES, DRAFT_LOOP]:
        if path.parent.name == "specpipe" or path.name in ("parallel.py", "parallel_worker.py"):
            continue  # they make their own ModelDraftSource / MultiSequenceShape and use it as such
        for attr, line in _attributes_read(path, on_source):
            if not _declared(DraftSource, attr):
                bad.append(f"{_rel(path)}:{line}: source.{attr} is not declared on DraftSource")
        for attr, line in _attributes_read(path, on_shape):
            if not _declared(TreeShape, attr):
                bad.append(f"{_rel(path)}:{line}: shape.{attr} is not declared on TreeShape / ShapePolicy")
    assert not bad, "\n".join(bad)


def test_what_the_sequential_step_reads_off_its_rows_is_declared():
    from specwood.engine.sequential import TargetRows

    bad = []
    for path in [ROOT / "engine" / "sequential.py"]:  # where SequentialStep drives them
        for attr, line in _attributes_read(path, re.compile(r"^(self\.)?rows$")):
            if not _declared(TargetRows, attr):
                bad.append(f"{_rel(path)}:{line}: rows.{attr} is not declared on TargetRows")
    assert not bad, "\n".join(bad)
    assert TargetRows.__abstractmethods__ == {"prefill_chunks", "prefill", "fits", "forward", "commit"}


def test_what_the_engine_reads_off_processors_and_executors_is_declared():
    proc = Processors(SamplingParams(presence_penalty=0.5), [1, 2], 8)
    bad = []
    for path in ENGINE_FILES:
        for attr, line in _attributes_read(path, re.compile(r"^(req|request|r|self)\.processors$")):
            if not hasattr(proc, attr):
                bad.append(f"{_rel(path)}:{line}: processors.{attr} is not a Processors attribute")
        for attr, line in _attributes_read(path, re.compile(r"^self\.executor$")):
            if not _declared(Executor, attr):
                bad.append(f"{_rel(path)}:{line}: executor.{attr} is not declared on Executor")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------
# the base classes and their implementations


def test_the_bases_declare_their_required_methods():
    assert DraftSource.__abstractmethods__ == {"start", "logits", "commit"}
    assert ShapePolicy.__abstractmethods__ == {"for_batch"}
    assert TreeShape.__abstractmethods__ == {"draft"}
    # the optional ones have defaults there: a plug-in overrides those of its roles
    for hook in ("on_step", "on_root_logits", "repeatable", "close", "max_nodes"):
        assert hook in vars(ShapePolicy) or hook in vars(TreeShape), hook
    for method in ("close", "attach", "defer", "prefill_part", "length", "shares_prefixes", "take_prompt_features",
                   "take_tree_features"):
        assert method in vars(DraftSource), method


def test_every_concrete_plugin_implements_its_base():
    _import_all()
    concrete = []
    for base in (DraftSource, ShapePolicy):
        for cls in _subclasses(base):
            if not cls.__module__.startswith("specwood.") or cls is TreeShape:
                continue
            assert not inspect.isabstract(cls), \
                f"{cls.__module__}.{cls.__qualname__} lacks {sorted(cls.__abstractmethods__)}"
            concrete.append(cls.__name__)
    for name in ("ModelDraftSource", "FeatureHeadSource", "LlamaCppDraftSource", "LayoutShape", "EagleShape",
                 "DySpecShape", "DySpecThresholdShape", "PromptLookupShape", "MultiSequenceShape", "SuffixShape",
                 "SuffixOrModelShape", "LookupOrModelShape", "PlannedShape"):
        assert name in concrete, name


def test_one_place_says_which_shapes_need_a_draft_model():
    from specwood.drafting.shapes import MODEL_SHAPES, SHAPE_CLASSES, SHAPES, make_shape, needs_model
    from specwood.methods import get_method

    assert SHAPES == list(SHAPE_CLASSES) and MODEL_SHAPES == [s for s in SHAPES if s != "pld"]
    for name in SHAPES:
        shape = make_shape(name)
        assert shape.needs_model == needs_model(name) == SHAPE_CLASSES[name].needs_model
        assert get_method(name).needs_draft == shape.needs_model
        assert ("pipeline" in get_method(name).executors) == shape.needs_model


def test_one_verdict_class():
    names = []
    for path in ROOT.rglob("*.py"):
        names += [n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)
                  and n.name == "Verdict"]
    assert names == ["Verdict"]


def test_the_forced_run_is_no_processors_state():
    proc = Processors(SamplingParams(presence_penalty=0.5), [1, 2], 8)
    assert not any(a.startswith("forced_") for a in vars(proc))


# the model's own passes, below the one forward over rows (models/batch.py)
MODEL_PASSES = re.compile(r"\.(hidden|hidden_packed|layers_over|row_blocks|row_block|vocab_logits)\(")
CACHELESS_PASSES = {ROOT / "drafting" / "head_training.py"}  # a draft head's training windows: no cache, no rows


def test_rows_of_every_kind_reach_the_model_through_one_forward():
    """Issue 59 item 4: prompt chunks, continuations, tree nodes and batch rows are each a RowInput
    of `models.batch.forward_rows(_features)`; nothing outside models/ runs the layers itself."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if "models" in path.relative_to(ROOT).parts or path in CACHELESS_PASSES:
            continue
        offenders += [f"{path.relative_to(ROOT)}: {ln.strip()}" for ln in path.read_text().splitlines()
                      if MODEL_PASSES.search(ln.split("#")[0])]
    assert not offenders, offenders
