"""Prometheus metrics, one registry per app.

Two sources: the HTTP layer counts what it sees (requests by endpoint and
status, generations by endpoint, lane and outcome, latency histograms), and
a collector reads :meth:`Engine.statistics` at scrape time for the engine's
own gauges and counters (rows, queues, arbiter state, tokens, drains,
preemptions, MLX memory and the prompt cache's bytes), so the numbers never
drift from the engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trio_mlx import EngineStatistics, GenerationResult, ModelHost
from trio_mlx_http._server.serve import ConnectionStatistics

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

#: Engine statistics exported as gauges (name in statistics -> help).
_GAUGES = {
    "running_rows": "Rows decoding in the continuous batch.",
    "queued_rows": "Requests waiting for a batch row.",
    "parked_rows": "Rows parked (preempted) with their cache, waiting to resume.",
    "waiting_jobs": "Serial or exclusive jobs waiting for the model.",
    "mlx_active_memory": "Bytes MLX holds in live arrays (weights, KV caches, prompt cache).",
    "mlx_cache_memory": "Bytes MLX keeps in freed buffers for reuse.",
    "mlx_peak_memory": "Highest active MLX memory since the process started, in bytes.",
    "prompt_cache_bytes": "Bytes the prompt cache counts for its entries.",
    "kv_memory_budget": "Bytes the requests' KV caches may hold at worst (the admission budget).",
    "kv_memory_reserved": "Worst-case KV bytes of the running and parked requests.",
}
#: Gauges whose exported name differs from the statistics field (Prometheus' unit suffix).
_GAUGE_NAMES = {
    "mlx_active_memory": "mlx_active_memory_bytes",
    "mlx_cache_memory": "mlx_cache_memory_bytes",
    "mlx_peak_memory": "mlx_peak_memory_bytes",
    "kv_memory_budget": "kv_memory_budget_bytes",
    "kv_memory_reserved": "kv_memory_reserved_bytes",
}
#: Engine statistics exported as counters (name in statistics -> help).
_COUNTERS = {
    "generated_tokens": "Tokens generated.",
    "drains": "Times the batch was drained for a serial or exclusive job.",
    "preemptions": "Batch rows parked to make room.",
    "steps": "Decode steps run.",
    "worker_busy_seconds": "Seconds the MLX thread spent running calls.",
    "admissions": "Step calls that inserted new rows (rows are admitted in groups).",
    "embedding_inputs": "Inputs embedded (their requests: trio_mlx_engine_requests, lane embed).",
    "embedding_tokens": "Tokens of the inputs embedded.",
}


@attrs.define(eq=False)
class _HostCollector:
    """A model host's models, read per scrape: state, use, loads and unloads."""

    host: ModelHost

    def collect(self) -> Iterable[Metric]:
        models = self.host.models()
        state = GaugeMetricFamily(
            "trio_mlx_model_state", "1 for each model's state.", labels=["model", "state"]
        )
        in_use = GaugeMetricFamily(
            "trio_mlx_model_requests", "Requests holding each model.", labels=["model"]
        )
        loads = CounterMetricFamily("trio_mlx_model_loads", "Model loads.", labels=["model"])
        unloads = CounterMetricFamily("trio_mlx_model_unloads", "Model unloads.", labels=["model"])
        for info in models:
            state.add_metric([info.name, info.state.value], 1)
            in_use.add_metric([info.name], info.in_use)
            loads.add_metric([info.name], info.loads)
            unloads.add_metric([info.name], info.unloads)
        yield from (state, in_use, loads, unloads)
        yield GaugeMetricFamily(
            "trio_mlx_host_active_memory_bytes",
            "MLX's active memory, every loaded model's included.",
            value=self.host.active_memory(),
        )


@attrs.frozen
class _EngineCollector:
    """Reads one statistics() snapshot per scrape."""

    statistics: Callable[[], EngineStatistics]

    def collect(self) -> Iterable[Metric]:
        stats = self.statistics()
        for name, doc in _GAUGES.items():
            exported = _GAUGE_NAMES.get(name, name)
            yield GaugeMetricFamily(f"trio_mlx_{exported}", doc, value=getattr(stats, name))
        yield GaugeMetricFamily(
            "trio_mlx_worker_alive",
            "1 while the MLX worker thread runs.",
            value=float(stats.worker_alive),
        )
        yield GaugeMetricFamily(
            "trio_mlx_adapters_mounted", "Mounted LoRA adapters.", value=len(stats.adapters)
        )
        yield GaugeMetricFamily(
            "trio_mlx_ranks",
            "Processes the model is sharded over (1: one process).",
            value=stats.ranks,
        )
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"trio_mlx_{name}", doc, value=getattr(stats, name))
        yield from _stall_bound(stats)
        prompt = CounterMetricFamily(
            "trio_mlx_prompt_tokens", "Prompt tokens, by cached or computed.", labels=["source"]
        )
        prompt.add_metric(["cached"], stats.cached_prompt_tokens)
        prompt.add_metric(["computed"], max(0, stats.prompt_tokens - stats.cached_prompt_tokens))
        yield prompt
        yield from _prompt_cache(stats)
        yield _by_lane(
            "trio_mlx_engine_requests",
            "Engine requests ended, by lane and outcome.",
            "outcome",
            stats.requests,
        )
        yield _by_lane(
            "trio_mlx_adapter_requests",
            "Engine requests ended that named an adapter, by lane and adapter.",
            "adapter",
            stats.adapter_requests,
        )
        rows = GaugeMetricFamily(
            "trio_mlx_adapter_rows",
            "Requests naming an adapter not yet ended (queued, decoding or parked), by lane.",
            labels=["lane", "adapter"],
        )
        for key, count in sorted(stats.adapter_rows.items()):
            lane, _, adapter = key.partition(":")
            rows.add_metric([lane, adapter], count)
        yield rows
        for name, what, counts in (
            ("trio_mlx_draft_tokens", "Speculative draft tokens verified", stats.draft_tokens),
            (
                "trio_mlx_draft_accepted_tokens",
                "Speculative draft tokens accepted",
                stats.draft_accepted_tokens,
            ),
        ):
            drafts = CounterMetricFamily(name, f"{what}, by method.", labels=["method"])
            for method, count in sorted(counts.items()):
                drafts.add_metric([method], count)
            yield drafts
        # One series per state, 1 for the current one (Prometheus' "state set" idiom).
        state = GaugeMetricFamily(
            "trio_mlx_arbiter_state", "1 for the arbiter's current state.", labels=["state"]
        )
        current = stats.arbiter.state
        for member in type(current):
            state.add_metric([member.value.lower()], float(member is current))
        yield state


def _prompt_cache(stats: EngineStatistics) -> Iterable[Metric]:
    """The prompt cache's entries, lookups and disk tier (nothing when it is off)."""
    cache = stats.prompt_cache
    if cache is None:
        return
    yield GaugeMetricFamily(
        "trio_mlx_prompt_cache_entries", "Prompt cache entries held in memory.", value=cache.entries
    )
    lookups = CounterMetricFamily(
        "trio_mlx_prompt_cache_lookups",
        "Prompt cache lookups, by whether a cached prefix was served.",
        labels=["result"],
    )
    lookups.add_metric(["hit"], cache.hits)
    lookups.add_metric(["miss"], cache.misses)
    yield lookups
    yield CounterMetricFamily(
        "trio_mlx_prompt_cache_reused_tokens",
        "Prompt tokens served from the prompt cache.",
        value=cache.tokens_reused,
    )
    yield GaugeMetricFamily(
        "trio_mlx_prompt_cache_disk_entries",
        "This model's entries in the prompt cache's disk folder.",
        value=cache.disk_entries,
    )
    yield GaugeMetricFamily(
        "trio_mlx_prompt_cache_disk_bytes",
        "Bytes of entries in the prompt cache's disk folder.",
        value=cache.disk_bytes,
    )
    disk = CounterMetricFamily(
        "trio_mlx_prompt_cache_disk_operations",
        "Prompt cache disk entries read back, written, and skipped as missing or corrupt.",
        labels=["operation"],
    )
    disk.add_metric(["read"], cache.disk_hits)
    disk.add_metric(["write"], cache.disk_writes)
    disk.add_metric(["skip"], cache.disk_failures)
    yield disk


#: The prefill stall bound's readings (``serve --prefill-stall``), exported once measured.
_STALL_GAUGES = {
    "prefill_chunk": (
        "trio_mlx_prefill_chunk_tokens",
        "Tokens a prompt is cut into per step under the stall bound (the last plan's).",
    ),
    "decode_step_seconds": (
        "trio_mlx_decode_step_seconds",
        "Moving average of a decode step that prefills nothing, as the stall bound reads it.",
    ),
    "prompt_token_seconds": (
        "trio_mlx_prompt_token_seconds",
        "Moving average of the seconds a prompt token adds to a step, as the stall bound reads it.",
    ),
}


def _stall_bound(stats: EngineStatistics) -> Iterable[Metric]:
    """The stall bound's gauges: only those it has a value for (none without a bound)."""
    for name, (exported, doc) in _STALL_GAUGES.items():
        value = getattr(stats, name)
        if value is not None:
            yield GaugeMetricFamily(exported, doc, value=value)


@attrs.define(eq=False)
class _ConnectionCollector:
    """Reads the connection guard's statistics per scrape."""

    statistics: Callable[[], ConnectionStatistics]

    def collect(self) -> Iterable[Metric]:
        stats = self.statistics()
        yield GaugeMetricFamily(
            "trio_mlx_http_connections_open", "HTTP connections held.", value=stats.open
        )
        yield GaugeMetricFamily(
            "trio_mlx_http_connections_peak",
            "Most HTTP connections held at once.",
            value=stats.peak,
        )
        yield CounterMetricFamily(
            "trio_mlx_http_connections_accepted", "HTTP connections served.", value=stats.accepted
        )
        yield CounterMetricFamily(
            "trio_mlx_http_connections_refused",
            "Connections answered 503 and closed: the connection cap was reached.",
            value=stats.refused,
        )
        yield CounterMetricFamily(
            "trio_mlx_http_write_timeouts",
            "Connections aborted because the client stopped reading.",
            value=stats.write_timeouts,
        )


@attrs.define(eq=False)
class Metrics:
    """The app's registry and the metrics the HTTP layer updates."""

    registry: CollectorRegistry = attrs.field(factory=CollectorRegistry)
    requests: Counter = attrs.field(init=False)
    generations: Counter = attrs.field(init=False)
    ttft: Histogram = attrs.field(init=False)
    duration: Histogram = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.requests = Counter(
            "trio_mlx_http_requests",
            "HTTP requests answered, by endpoint and status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.generations = Counter(
            "trio_mlx_http_generations",
            "Choices generated over HTTP, by endpoint, lane and outcome.",
            ["endpoint", "lane", "outcome"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "trio_mlx_time_to_first_token_seconds",
            "Seconds from submission to the first token.",
            ["lane"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "trio_mlx_request_duration_seconds",
            "Seconds a generation request took, end to end.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def watch_engine(self, statistics: Callable[[], EngineStatistics]) -> None:
        """Export the engine's statistics on every scrape."""
        self.registry.register(_EngineCollector(statistics))

    def watch_host(self, host: ModelHost) -> None:
        """Export a model host's models on every scrape."""
        self.registry.register(_HostCollector(host))

    def watch_connections(self, statistics: Callable[[], ConnectionStatistics]) -> None:
        """Export the connection guard's statistics on every scrape."""
        self.registry.register(_ConnectionCollector(statistics))

    def finished(self, endpoint: str, result: GenerationResult) -> None:
        """Count one finished choice (its outcome is its finish reason)."""
        self.generations.labels(endpoint, result.lane, result.finish_reason).inc()
        if result.time_to_first_token is not None:
            self.ttft.labels(result.lane).observe(result.time_to_first_token)

    def failed(self, endpoint: str, outcome: str) -> None:
        """Count a choice that ended without a result (error or a gone client)."""
        self.generations.labels(endpoint, "none", outcome).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


def _by_lane(name: str, doc: str, label: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    """A counter family from the engine's ``"lane:value"`` keyed counts."""
    family = CounterMetricFamily(name, doc, labels=["lane", label])
    for key, count in sorted(counts.items()):
        lane, _, value = key.partition(":")
        family.add_metric([lane, value], count)
    return family
