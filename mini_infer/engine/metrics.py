"""Prometheus metrics of a serving engine (vLLM's metric names under the `mini_infer:` prefix).

Updated from the engine thread only: when a request is added or aborted, from every step's outputs, and from
the scheduler's state after each step. A data-parallel engine's replica deaths, restarts and live count are read
when /metrics is scraped (watch_replicas), so they are current while the engine idles too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mini_infer.engine.scheduler import SchedulerStats
from mini_infer.engine.speculation import SpecDecodeStats
from mini_infer.outputs import PoolingRequestOutput, RequestOutput

if TYPE_CHECKING:
    from mini_infer.engine.replicas import ReplicaHealth

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 320.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0)
FINISH_REASONS = ("stop", "length", "abort", "error")  # error: a data-parallel replica died under the request


@dataclass(slots=True)
class _Timing:
    arrival: float
    last_token: float | None = None  # None until the first token


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels, kw = ["model_name"], dict(registry=self.registry)
        self.model_name = model_name
        self._timings: dict[str, _Timing] = {}
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)

        def one(metric):  # a metric with this server's label values bound
            return metric.labels(model_name=model_name)

        self.running = one(Gauge("mini_infer:num_requests_running", "Requests in the running batch.", labels, **kw))
        self.waiting = one(Gauge("mini_infer:num_requests_waiting", "Requests waiting to be scheduled.", labels, **kw))
        self.kv_cache_usage = one(Gauge("mini_infer:kv_cache_usage_perc",
                                        "Fraction of KV cache blocks in use (0 to 1).", labels, **kw))
        self.prompt_tokens = one(Counter("mini_infer:prompt_tokens", "Prompt tokens prefilled.", labels, **kw))
        self.generation_tokens = one(Counter("mini_infer:generation_tokens", "Tokens generated.", labels, **kw))
        self.preemptions = one(Counter("mini_infer:num_preemptions", "Requests preempted (to be recomputed).",
                                       labels, **kw))
        self.prefix_queries = one(Counter("mini_infer:prefix_cache_queries",
                                          "Prompt tokens looked up in the prefix cache.", labels, **kw))
        self.prefix_hits = one(Counter("mini_infer:prefix_cache_hits", "Prompt tokens served by the prefix cache.",
                                       labels, **kw))
        # Speculative decoding (vLLM's spec_decode counters), running totals of the scheduler's SpecDecodeStats.
        self.spec_drafts = one(Counter("mini_infer:spec_decode_num_drafts", "Verify steps of a request with drafts.",
                                       labels, **kw))
        self.spec_draft_tokens = one(Counter("mini_infer:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                             labels, **kw))
        self.spec_accepted = one(Counter("mini_infer:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                         labels, **kw))
        self.spec_emitted = one(Counter("mini_infer:spec_decode_num_emitted_tokens",
                                        "Tokens emitted by verify steps (accepted drafts and one more each).",
                                        labels, **kw))
        self._spec_per_position = Counter("mini_infer:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by their position among a step's drafts.",
                                          labels + ["position"], **kw)
        self._spec_seen = SpecDecodeStats()
        success = Counter("mini_infer:request_success", "Requests finished, by finish reason.",
                          labels + ["finished_reason"], **kw)
        self.success = {reason: success.labels(model_name=model_name, finished_reason=reason)
                        for reason in FINISH_REASONS}
        self.ttft = one(Histogram("mini_infer:time_to_first_token_seconds", "Time to first token.", labels,
                                  buckets=_LATENCY_BUCKETS, **kw))
        self.itl = one(Histogram("mini_infer:inter_token_latency_seconds", "Time between consecutive tokens.",
                                 labels, buckets=_ITL_BUCKETS, **kw))
        self.e2e = one(Histogram("mini_infer:e2e_request_latency_seconds", "Arrival to last token, per finished "
                                 "request.", labels, buckets=_LATENCY_BUCKETS, **kw))

    def watch_replicas(self, read: Callable[[], list[ReplicaHealth]]) -> None:
        """Export a data-parallel engine's replicas as `read` (its replica_health) gives them at each scrape."""
        self.registry.register(_ReplicaCollector(self.model_name, read))

    def on_add(self, request_id: str, now: float) -> None:
        self._timings[request_id] = _Timing(arrival=now)

    def on_abort(self, request_id: str) -> None:
        if self._timings.pop(request_id, None) is not None:
            self.success["abort"].inc()

    def on_outputs(self, outputs: list[RequestOutput | PoolingRequestOutput], now: float) -> None:
        """Count the tokens of a step's DELTA outputs and time them (a pooling request's one output: its prompt)."""
        for output in outputs:
            timing = self._timings.get(output.request_id)
            if timing is None:  # not tracked here (already aborted)
                continue
            if isinstance(output, PoolingRequestOutput):
                del self._timings[output.request_id]
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                self.e2e.observe(now - timing.arrival)
                self.success["stop"].inc()
                continue
            num_new = sum(len(completion.token_ids) for completion in output.outputs)  # n > 1: every completion's
            if num_new:
                if timing.last_token is None:
                    self.ttft.observe(now - timing.arrival)
                    self.prompt_tokens.inc(len(output.prompt_token_ids))
                else:
                    self.itl.observe(now - timing.last_token)
                timing.last_token = now
                self.generation_tokens.inc(num_new)
            if output.finished:
                del self._timings[output.request_id]
                self.e2e.observe(now - timing.arrival)
                self.success[output.outputs[-1].finish_reason].inc()  # n > 1: the completion that finished last

    def on_state(self, stats: SchedulerStats) -> None:
        """The scheduler's state after a step; preemptions and prefix-cache tokens are running totals."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        if stats.num_preemptions > self._preemptions_seen:
            self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions
        queries_seen, hits_seen = self._prefix_seen
        self.prefix_queries.inc(stats.prefix_queries - queries_seen)
        self.prefix_hits.inc(stats.prefix_hits - hits_seen)
        self._prefix_seen = (stats.prefix_queries, stats.prefix_hits)
        spec, seen = stats.spec_decode, self._spec_seen
        self.spec_drafts.inc(spec.num_drafts - seen.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens - seen.num_draft_tokens)
        self.spec_accepted.inc(spec.num_accepted_tokens - seen.num_accepted_tokens)
        self.spec_emitted.inc(spec.num_emitted_tokens - seen.num_emitted_tokens)
        for position, count in enumerate(spec.accepted_per_position):
            before = seen.accepted_per_position[position] if position < len(seen.accepted_per_position) else 0
            self._spec_per_position.labels(model_name=self.model_name, position=str(position)).inc(count - before)
        self._spec_seen = spec


class _ReplicaCollector:
    """Replica deaths and restarts (counters, one series per replica) and the live replicas (a gauge)."""

    def __init__(self, model_name: str, read: Callable[[], list[ReplicaHealth]]) -> None:
        self.model_name, self.read = model_name, read

    def describe(self):
        return []  # (no scrape at registration: the engine may still be starting)

    def collect(self):
        replicas = self.read()
        deaths = CounterMetricFamily("mini_infer:dp_replica_deaths", "Data-parallel replica processes that died.",
                                     labels=["model_name", "replica"])
        restarts = CounterMetricFamily("mini_infer:dp_replica_restarts", "Data-parallel replica processes started "
                                       "again after a death.", labels=["model_name", "replica"])
        for replica in replicas:
            deaths.add_metric([self.model_name, str(replica.replica)], replica.deaths)
            restarts.add_metric([self.model_name, str(replica.replica)], replica.restarts)
        live = GaugeMetricFamily("mini_infer:dp_replicas_live", "Data-parallel replicas taking requests.",
                                 labels=["model_name"])
        live.add_metric([self.model_name], sum(r.state == "live" for r in replicas))
        yield from (deaths, restarts, live)
