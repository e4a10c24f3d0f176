"""Prometheus metrics of one server (its own CollectorRegistry), with vLLM-style names.

Speculative-decoding counters come from the scheduler's step records (an observer called from the
scheduler thread after every decode step); request counters and latency histograms from each
request's end (`on_finish`, also the scheduler thread). prometheus-client is thread-safe.
"""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specwood.drafting.suffix_source import suffix_caches
from specwood.engine.request import Request, State
from specwood.engine.scheduler import Scheduler
from specwood.engine.step import StepRecord

P = "specwood:"
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_REQUEST = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0)
_TPOT = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
         0.4, 0.5, 0.75, 1.0, 2.5)
THROUGHPUT_WINDOW = 64  # decode steps averaged by the tokens/s gauge


def _suffix_total(key: str) -> float:
    """A global suffix cache statistic summed over the process's caches (one per model)."""
    stats = [c.stats() for c in suffix_caches()]
    if key == "hit_rate":
        queries = sum(s["queries"] for s in stats)
        return sum(s["hits"] for s in stats) / queries if queries else 0.0
    return float(sum(s[key] for s in stats))


class ServerMetrics:
    """Every metric of one app. `observe_step` is the scheduler observer; `request_submitted` and
    `request_finished` bracket each request."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, scheduler: Scheduler, model_name: str = ""):
        self.registry = r = CollectorRegistry()
        self.scheduler = scheduler
        # speculative decoding (vLLM: vllm:spec_decode_*)
        self.num_drafts = Counter(P + "spec_decode_num_drafts", "Speculative steps (a drafted tree was verified)",
                                  registry=r)
        self.num_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Drafted tokens (tree nodes) verified",
                                        registry=r)
        self.num_accepted_tokens = Counter(P + "spec_decode_num_accepted_tokens",
                                           "Drafted tokens accepted (bonus tokens not counted)", registry=r)
        self.accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted drafted tokens by position along the accepted path (0 = first)",
                                        ["position"], registry=r)
        # scheduler state (read at scrape time)
        Gauge(P + "num_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: scheduler.num_running)
        Gauge(P + "num_requests_waiting", "Requests waiting for a batch slot", registry=r).set_function(
            lambda: scheduler.num_waiting)
        # tokens and requests
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests by finish reason (stop, length; "
                                       "cancelled = the client went away)", ["finished_reason"], registry=r)
        self.request_failures = Counter(P + "request_failures", "Requests that failed inside the engine",
                                        registry=r)
        self.requests_rejected = Counter(P + "requests_rejected", "Requests refused with 503 (queue full)",
                                         registry=r)
        self.uploads_dropped = Counter(P + "request_uploads_dropped", "Requests whose client disconnected before "
                                       "their body arrived (cancelled before they started)", registry=r)
        # latencies
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token (request arrival to first "
                              "token)", buckets=_LATENCY, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Mean time per output token after the first, "
                              "per request", buckets=_TPOT, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request arrival to its last token",
                             buckets=_REQUEST, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Request arrival until the scheduler "
                                    "admitted it to the running batch (resolution: a few ms)", buckets=_REQUEST,
                                    registry=r)
        # decode throughput
        self.decode_tokens = Counter(P + "decode_tokens", "Tokens produced by decode steps (accepted + bonus; a "
                                     "request's last step may produce more than it keeps)", registry=r)
        self.decode_seconds = Counter(P + "decode_seconds", "Time spent in decode steps (draft + verify)",
                                      registry=r)
        self.decode_steps = Counter(P + "decode_steps", "Decode steps (one target forward each)", registry=r)
        self._window: collections.deque[tuple[int, float]] = collections.deque(maxlen=THROUGHPUT_WINDOW)
        self._window_lock = threading.Lock()
        Gauge(P + "decode_tokens_per_second", f"Decode throughput of all running requests over the last "
              f"{THROUGHPUT_WINDOW} decode steps (tokens emitted / step time); 0 when idle",
              registry=r).set_function(self.decode_tokens_per_second)
        # the global suffix cache (suffix, auto): the server's earlier answers, read at scrape time
        for name, doc, key in (("suffix_cache_tokens", "Tokens held by the global suffix cache", "tokens"),
                               ("suffix_cache_capacity_tokens", "The global suffix cache's bound "
                                "(--suffix-cache-tokens)", "capacity"),
                               ("suffix_cache_bytes", "Bytes held by the global suffix cache's index (fixed by "
                                "its capacity)", "bytes"),
                               ("suffix_cache_answers", "Answers added to the global suffix cache", "answers"),
                               ("suffix_cache_queries", "Lookups in the global suffix cache", "queries"),
                               ("suffix_cache_hits", "Lookups that found a continuation", "hits"),
                               ("suffix_cache_hit_rate", "Hits over lookups of the global suffix cache", "hit_rate")):
            Gauge(P + name, doc, registry=r).set_function(lambda key=key: _suffix_total(key))
        r.register(PrefixCacheCollector(scheduler))
        if model_name:
            Gauge(P + "model_info", "The served model", ["model_name"], registry=r).labels(model_name).set(1)
        self._pending: dict[Request, float] = {}  # submitted, not yet seen running -> arrival time
        self._pending_lock = threading.Lock()

    # --- the scheduler observer (scheduler thread) --------------------------------------------

    def observe_step(self, record: StepRecord) -> None:
        try:
            emitted = 0
            for nodes, accepted, _depth in record.drafts:
                emitted += accepted + 1
                if nodes <= 0:
                    continue
                self.num_drafts.inc()
                self.num_draft_tokens.inc(nodes)
                if accepted:
                    self.num_accepted_tokens.inc(accepted)
                    for pos in range(accepted):
                        self.accepted_per_pos.labels(str(pos)).inc()
            seconds = max(record.draft_s + record.verify_s, 0.0)
            self.decode_tokens.inc(emitted)
            self.decode_seconds.inc(seconds)
            self.decode_steps.inc()
            with self._window_lock:
                self._window.append((emitted, seconds))
        except Exception:  # noqa: BLE001 - metrics must never stop the scheduler
            pass

    # --- queue time -----------------------------------------------------------------------------

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def sample_admissions(self) -> None:
        """Observe the queue time of every pending request the scheduler has admitted since the
        last call (its state left WAITING). The app calls this every few milliseconds while
        requests are pending, so the resolution is that period (exact where the engine stamps
        `Request.t_admitted`)."""
        now = time.perf_counter()
        with self._pending_lock:
            for req in [q for q in self._pending if q.state is not State.WAITING]:
                arrival = self._pending.pop(req)
                t = getattr(req, "t_admitted", None)
                self.queue_time.observe(max((t if isinstance(t, float) else now) - arrival, 0.0))

    def decode_tokens_per_second(self) -> float:
        if self.scheduler.idle:
            return 0.0
        with self._window_lock:
            tokens = sum(t for t, _ in self._window)
            seconds = sum(s for _, s in self._window)
        return tokens / seconds if seconds > 0 else 0.0

    # --- requests -------------------------------------------------------------------------------

    def request_submitted(self, req: Request, arrival: float) -> None:
        with self._pending_lock:
            self._pending[req] = arrival

    def request_rejected(self, req: Request) -> None:
        """A request that never entered the queue (it was full)."""
        with self._pending_lock:
            self._pending.pop(req, None)
        self.requests_rejected.inc()

    def upload_dropped(self) -> None:
        self.uploads_dropped.inc()

    def request_finished(self, req: Request, arrival: float) -> None:
        """At a request's end (scheduler thread): tokens, finish reason, latencies."""
        try:
            end = time.perf_counter()
            with self._pending_lock:
                queued_since = self._pending.pop(req, None)  # finished before a sample saw it admitted
            if req.error is not None or req.result is None:
                self.request_failures.inc()
                return
            res = req.result
            n = len(res.token_ids)
            self.prompt_tokens.inc(len(req.prompt_ids))
            self.generation_tokens.inc(n)
            self.request_success.labels(res.finish_reason).inc()
            if res.finish_reason == "cancelled":
                return
            stats = res.stats
            ttft = stats.get("ttft_s")
            t_first = None
            if isinstance(ttft, (int, float)):
                # stats count from the request's creation, a moment after its arrival here
                start = end - float(stats.get("total_s") or 0.0)
                t_first = start + float(ttft)
                self.ttft.observe(max(t_first - arrival, 0.0))
            if queued_since is not None and t_first is not None:  # an upper bound: to its first token
                self.queue_time.observe(max(min(t_first, end) - queued_since, 0.0))
            if n > 1 and t_first is not None:
                self.tpot.observe(max(end - t_first, 0.0) / (n - 1))
            self.e2e.observe(max(end - arrival, 0.0))
        except Exception:  # noqa: BLE001 - metrics must never fail a request
            pass

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PrefixCacheCollector:
    """The prefix cache's counts at scrape time (specwood.models.prefix_cache; zeros where the
    executor reuses nothing): tokens looked up and found per model, bytes held, evictions."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        cache = self.scheduler.executor.prefix_cache
        queries = CounterMetricFamily(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels=["model"])
        hits = CounterMetricFamily(P + "prefix_cache_hits", "Prompt tokens whose K/V came from the prefix cache "
                                   "(a finished request's entry or a running request's row) instead of a prefill",
                                   labels=["model"])
        evictions = CounterMetricFamily(P + "prefix_cache_evictions", "Prefix cache entries evicted to fit the "
                                        "budget (least recently used first)")
        held = GaugeMetricFamily(P + "prefix_cache_bytes", "Bytes of K/V held by prefix cache entries")
        budget = GaugeMetricFamily(P + "prefix_cache_budget_bytes", "The prefix cache's budget (--kv-memory less "
                                   "the cache rows)")
        rows = GaugeMetricFamily(P + "kv_rows_bytes", "Bytes of the cache rows of every model (they grow with the "
                                 "longest running request within --kv-memory)")
        row_len = GaugeMetricFamily(P + "kv_row_slots", "Slots of each cache row now")
        tokens = GaugeMetricFamily(P + "prefix_cache_tokens", "Tokens held by prefix cache entries (all models)")
        for model in ("target", "draft"):
            stats = cache.stats if cache is not None else None
            queries.add_metric([model], stats.query_tokens.get(model, 0) if stats else 0)
            hits.add_metric([model], stats.hit_tokens.get(model, 0) if stats else 0)
        evictions.add_metric([], cache.stats.evictions if cache is not None else 0)
        held.add_metric([], cache.nbytes if cache is not None else 0)
        budget.add_metric([], cache.budget_bytes if cache is not None else 0)
        tokens.add_metric([], cache.cached_tokens if cache is not None else 0)
        executor = self.scheduler.executor
        rows.add_metric([], executor.rows_bytes())
        row_len.add_metric([], executor.row_len)
        return [queries, hits, evictions, held, budget, tokens, rows, row_len]
