"""Prometheus metrics of the gateway, under vLLM-style names with the `kvrelay:` prefix.

Each gateway owns its registry (several gateways can live in one test process). Per-tenant
labels are bounded: the first `max_tenant_labels` tenant ids seen get their own label value,
later ones are counted under `other`. API keys never reach a label.
"""

from __future__ import annotations

from collections.abc import Callable

from kvrelay.kvtransfer.metrics import (
    expert_load_metrics,
    lora_metrics,
    parallel_metrics,
    spec_decode_metrics,
)
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
OTHER_TENANT = "other"
ALL_TENANTS = "all"


GAUGES = {  # name -> (help, labels)
    "kvrelay:num_requests_waiting": ("Requests waiting: in the gateway queue and in the engine's queue", ["model"]),
    "kvrelay:num_requests_running": ("Requests running on the workers", ["model"]),
    "kvrelay:gateway_queue_depth": ("Requests waiting in the gateway queue (the autoscaling signal)",
                                    ["model", "role"]),
    "kvrelay:kv_cache_usage_perc": ("Fraction of KV cache blocks in use (0-1)", ["model"]),
}


class _GaugeCollector:
    """Gauges read at scrape time from the live queue and backend."""

    def __init__(self, read: Callable[[], dict[str, list[tuple[dict[str, str], float]]]]):
        self._read = read

    def describe(self):
        for name, (help_text, labels) in GAUGES.items():
            yield GaugeMetricFamily(name, help_text, labels=labels)

    def collect(self):
        values = self._read()
        for name, (help_text, labels) in GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=labels)
            for label_values, value in values.get(name, []):
                family.add_metric([label_values[k] for k in labels], value)
            yield family


class _EngineCounters:
    """Counters of an in-process engine (`serve`) that the workers export too: prefix cache,
    preemptions, speculative decoding, expert load."""

    def __init__(self, stats: Callable[[], object | None]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        if s is None:
            return
        for name, doc, value in (
            ("kvrelay:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("kvrelay:prefix_cache_hits", "Prompt tokens served by the prefix cache.", s.prefix_cache_hits),
            ("kvrelay:num_preemptions", "Sequences preempted (recompute).", s.num_preemptions),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield from spec_decode_metrics(s)
        yield from parallel_metrics(s)
        yield from expert_load_metrics(s)
        yield from lora_metrics(s)


class GatewayMetrics:
    def __init__(self, max_tenant_labels: int = 100, per_tenant: bool = True):
        self.registry = CollectorRegistry(auto_describe=True)
        self.max_tenant_labels = max_tenant_labels
        self.per_tenant = per_tenant  # False: every tenant is counted under `all`
        self._tenant_labels: set[str] = set()
        r = self.registry
        self.ttft = Histogram("kvrelay:time_to_first_token_seconds", "Time from arrival to the first token",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvrelay:inter_token_latency_seconds", "Time between streamed increments",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvrelay:e2e_request_latency_seconds", "Time from arrival to the last token",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("kvrelay:request_queue_time_seconds", "Time waiting in the gateway queue",
                                    ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvrelay:prompt_tokens", "Prompt tokens processed",
                                     ["model", "tenant"], registry=r)
        self.generation_tokens = Counter("kvrelay:generation_tokens", "Tokens generated",
                                         ["model", "tenant"], registry=r)
        self.requests = Counter("kvrelay:request_success", "Finished requests by finish reason",
                                ["model", "tenant", "finished_reason"], registry=r)
        self.quota_rejections = Counter("kvrelay:quota_rejections", "Requests rejected by a tenant quota",
                                        ["tenant", "limit"], registry=r)
        self.errors = Counter("kvrelay:request_errors", "Requests answered with an error status",
                              ["status"], registry=r)

    def attach_gauges(self, read: Callable[[], dict[str, list[tuple[dict[str, str], float]]]],
                      engine_stats: Callable[[], object | None] | None = None) -> None:
        self.registry.register(_GaugeCollector(read))
        if engine_stats is not None:
            self.registry.register(_EngineCounters(engine_stats))

    def tenant(self, tenant_id: str) -> str:
        """The label value for a tenant, bounded in cardinality."""
        if not self.per_tenant:
            return ALL_TENANTS
        if tenant_id in self._tenant_labels:
            return tenant_id
        if len(self._tenant_labels) < self.max_tenant_labels:
            self._tenant_labels.add(tenant_id)
            return tenant_id
        return OTHER_TENANT

    def exposition(self, per_tenant: bool = True) -> bytes:
        """The text format; per_tenant=False sums every series over its tenant label (the API port's view:
        no tenant id leaves the gateway there)."""
        return generate_latest(self.registry if per_tenant else _TenantFolded(self.registry))


class _TenantFolded:
    """A registry view with the `tenant` label dropped and the series summed over it."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self):
        for family in self._registry.collect():
            if not any("tenant" in s.labels for s in family.samples):
                yield family
                continue
            sums: dict[tuple, float] = {}
            for s in family.samples:
                if s.name.endswith("_created"):  # creation times do not sum
                    continue
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "tenant"))
                sums[(s.name, labels)] = sums.get((s.name, labels), 0.0) + s.value
            folded = Metric(family.name, family.documentation, family.type, family.unit)
            for (name, labels), value in sums.items():
                folded.add_sample(name, dict(labels), value)
            yield folded
