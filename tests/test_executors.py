"""One request lifecycle for every executor: the same workload through the one Scheduler on the
sequential, parallel (DuoDecoding's worker process) and pipeline (SpecPipe's rank processes)
executors gives the same greedy output as plain decoding, and a request that raises fails alone on
each of them while the others finish."""
from __future__ import annotations

import time

import pytest

from specwood.engine.api import Engine
from specwood.engine.executor import Executor
from specwood.engine.parallel import ParallelExecutor
from specwood.engine.request import State
from specwood.engine.specpipe.launch import PipelineExecutor
from specwood.engine.scheduler import Scheduler, SchedulerConfig
from specwood.engine.sequential import SequentialExecutor
from specwood.errors import DeadlineExceeded, SpecwoodError

from conftest import make_tiny_model, make_tiny_tokenizer, perturbed_copy

PROMPTS = ["def add(a, b):", "Once upon a time", "1, 2, 3, 4, 5, 1, 2, 3,", "The quick brown fox"]
MAX_TOKENS = [24, 12, 30, 18]
FAILING = 1  # the request whose consumer raises after its third piece of text
# each executor's speculative method (the pipeline's are its modes)
METHODS = {"sequential": ["dyspec", "ar", "eagle", "pld"], "parallel": ["duo"] * 4,
           "pipeline": ["specpipe", "pp", "specpipe", "specinfer"]}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine():
    target = make_tiny_model(seed=0, n_layers=3)
    return Engine(target, make_tiny_tokenizer(), draft=perturbed_copy(target, 0.3, seed=1), target_name="tiny",
                  draft_name="tiny-draft")


def make_executor(name: str, engine: Engine) -> Executor:
    if name == "sequential":
        return SequentialExecutor(engine.target, SchedulerConfig(max_batch=4, row_len=256, tree_room=64))
    if name == "parallel":
        return ParallelExecutor(engine, draft_threads=1, verbose=False, catch_up=False)
    return PipelineExecutor(engine, 2, width=4, topk=4, threads=1, max_lanes=4)


class RaisingConsumer:
    def __init__(self, after: int):
        self.after, self.pieces = after, 0

    def __call__(self, text: str) -> None:
        self.pieces += 1
        if self.pieces > self.after:
            raise RuntimeError("the consumer went away")


@pytest.mark.parametrize("name", ["sequential", "parallel", "pipeline"])
def test_one_workload_through_every_executor(engine, name):
    expected = [engine.generate(p, max_tokens=n, raw=True, method="ar").token_ids for p, n in zip(PROMPTS, MAX_TOKENS)]
    executor = make_executor(name, engine)
    scheduler = Scheduler(executor, SchedulerConfig(max_batch=4, max_queue=8))
    try:
        requests = [scheduler.make_request(engine, p, max_tokens=n, raw=True, method=m,
                                           on_text=RaisingConsumer(3) if i == FAILING else None)
                    for i, (p, n, m) in enumerate(zip(PROMPTS, MAX_TOKENS, METHODS[name]))]
        for req in requests:
            scheduler.submit(req)
        scheduler.run_until_done(requests)
    finally:
        scheduler.stop()
    for i, (req, ref) in enumerate(zip(requests, expected)):
        assert req.done.is_set()
        if i == FAILING:
            assert req.result is None and req.error and "consumer went away" in req.error, (name, req.error)
        else:
            assert req.error is None, (name, i, req.error)
            assert req.result.token_ids == ref, (name, i)
    assert scheduler.idle and scheduler.failure is None


def test_a_step_answers_its_requests_after_its_record_is_observed(engine):
    """The server's /metrics observe each step's record: a client answered by a step must find that
    step counted when it scrapes right after (the sequential executor steps one decode step)."""
    scheduler = Scheduler(make_executor("sequential", engine), SchedulerConfig(max_batch=4, max_queue=8))
    requests = [scheduler.make_request(engine, p, max_tokens=n, raw=True, method="dyspec")
                for p, n in zip(PROMPTS, MAX_TOKENS)]
    seen: list[list[tuple[bool, bool]]] = []  # per observed record: each request finished?, answered?
    scheduler.observers.append(lambda rec: seen.append([(r.state is State.FINISHED, r.done.is_set())
                                                        for r in requests]))
    for req in requests:
        scheduler.submit(req)
    scheduler.run_until_done(requests)
    assert all(r.error is None and r.done.is_set() for r in requests)
    for i in range(len(requests)):
        # the step that finished request i was observed before i was answered, and only that one
        states = [record[i] for record in seen]
        assert states.count((True, False)) == 1, (i, states)
        assert states.index((True, False)) == states.count((False, False)), (i, states)


class SlowConsumer:
    """Takes `seconds` over its first piece of text (a slow client)."""

    def __init__(self, seconds: float):
        self.seconds, self.pieces = seconds, 0

    def __call__(self, text: str) -> None:
        self.pieces += 1
        if self.pieces == 1:
            time.sleep(self.seconds)


LATE = 2  # the request that runs past its deadline (30 tokens: it is still running when it expires)


@pytest.mark.parametrize("name", ["sequential", "parallel", "pipeline"])
def test_a_request_past_its_deadline_fails_alone_on_every_executor(engine, name):
    expected = [engine.generate(p, max_tokens=n, raw=True, method="ar").token_ids for p, n in zip(PROMPTS, MAX_TOKENS)]
    scheduler = Scheduler(make_executor(name, engine), SchedulerConfig(max_batch=4, max_queue=8))
    try:
        requests = [scheduler.make_request(engine, p, max_tokens=n, raw=True, method=m,
                                           on_text=SlowConsumer(0.6) if i == LATE else None)
                    for i, (p, n, m) in enumerate(zip(PROMPTS, MAX_TOKENS, METHODS[name]))]
        for i, req in enumerate(requests):
            scheduler.submit(req, timeout_s=0.3 if i == LATE else 600)
        scheduler.run_until_done(requests)
    finally:
        scheduler.stop()
    for i, (req, ref) in enumerate(zip(requests, expected)):
        if i == LATE:
            assert isinstance(req.exception, DeadlineExceeded), (name, req.error, req.result)
            assert "ran past its 0.3 s deadline" in req.error
        else:
            assert req.error is None and req.result.token_ids == ref, (name, i, req.error)
    assert scheduler.idle and scheduler.failure is None
    with pytest.raises(SpecwoodError, match="timeout_s must be > 0"):
        scheduler.submit(scheduler.make_request(engine, "hi", max_tokens=2, raw=True, method=METHODS[name][1]),
                         timeout_s=0)


# --- the registry says what runs where ------------------------------------------------------------


def test_the_registry_says_which_executors_and_backends_each_method_runs_on(engine):
    from specwood.engine.executor import EXECUTORS
    from specwood.engine.executors import PLUGINS, needs_draft_on
    from specwood.methods import check_backend, get_method, method_names, method_on, prepare_method

    assert set(PLUGINS) == set(EXECUTORS)
    for name in method_names(None):
        assert set(get_method(name).executors) <= set(EXECUTORS), name
    # every method the test above sends to an executor is one the registry lists for it
    for executor, methods in METHODS.items():
        assert set(methods) <= set(method_names(executor)), executor
    assert method_names("parallel") == ["duo"]
    assert "specpipe" not in method_names() and "pld" not in method_names("pipeline")
    # a sequential name means the executor's own method there
    assert method_on("parallel", "ar") == method_on("parallel", "auto") == "duo"
    assert (method_on("pipeline", "auto"), method_on("pipeline", "ar"), method_on("pipeline", "eagle")) == \
        ("specpipe", "pp", "eagle")
    with pytest.raises(SpecwoodError, match="executor 'parallel' runs method 'duo', not 'eagle'"):
        method_on("parallel", "eagle")
    with pytest.raises(SpecwoodError, match="not 'pld'"):
        method_on("pipeline", "pld")
    # a pipeline method asked of the sequential executor says where it runs
    with pytest.raises(SpecwoodError, match="runs on the pipeline executor"):
        engine.generate("hi", max_tokens=2, method="specpipe")
    assert (needs_draft_on(None, "ar"), needs_draft_on("parallel", "ar"), needs_draft_on("pipeline", "ar"),
            needs_draft_on("pipeline", "auto")) == (False, True, False, True)
    # methods that read the target's own layers or features need a torch target
    with pytest.raises(SpecwoodError, match="method 'head' needs a torch target, not llama.cpp"):
        check_backend("head", "llama.cpp")
    check_backend("dyspec", "llama.cpp")

    class OnLlamaCpp:
        backend = "llama.cpp"
        draft_model = None

    with pytest.raises(SpecwoodError, match="needs a torch target"):
        prepare_method(OnLlamaCpp(), "early-exit")
