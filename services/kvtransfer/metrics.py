"""Prometheus metrics of a prefill or decode worker, vLLM-style names under `kvrelay:`.

Each worker owns a CollectorRegistry (several workers can live in one test process). Engine
gauges and totals are read from EngineStats at scrape time; latencies and KV-transfer figures
are observed by the worker code.
"""

from __future__ import annotations

from kvrelay.engine.parallel.rank_metrics import rank_metrics
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
SPEED_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class EngineStatsCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        for name, doc, value in (
            ("kvrelay:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kvrelay:num_requests_running", "Requests in the running batch.", s.num_running),
            ("kvrelay:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", s.kv_usage),
            ("kvrelay:kv_cache_blocks_free", "KV blocks free (evictable cached blocks count as free).",
             s.kv_blocks_free),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("kvrelay:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("kvrelay:prefix_cache_hits", "Prompt tokens served by the prefix cache.", s.prefix_cache_hits),
            ("kvrelay:num_preemptions", "Sequences preempted (recompute).", s.num_preemptions),
            ("kvrelay:prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens_total),
            ("kvrelay:generation_tokens", "Tokens generated.", s.generation_tokens_total),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield from spec_decode_metrics(s)
        yield from parallel_metrics(s)
        yield from expert_load_metrics(s)
        yield from lora_metrics(s)


def lora_metrics(s):
    """Requests running and waiting per LoRA adapter (only when the engine serves adapters)."""
    for key, name, doc in (("lora_running", "kvrelay:lora_requests_running", "Requests in the running batch"),
                           ("lora_waiting", "kvrelay:lora_requests_waiting", "Requests waiting to be scheduled")):
        counts = getattr(s, key, None)
        if counts:
            gauge = GaugeMetricFamily(name, f"{doc}, by LoRA adapter.", labels=["lora"])
            for lora, value in sorted(counts.items()):
                gauge.add_metric([lora], value)
            yield gauge


def parallel_metrics(s):
    """Tensor/pipeline parallel step and communication totals (only when the engine runs ranks)."""
    if not s.parallel_steps:
        return
    yield CounterMetricFamily("kvrelay:parallel_steps", "Steps run by the parallel worker processes.",
                              value=s.parallel_steps)
    yield CounterMetricFamily("kvrelay:parallel_step_seconds", "Step time of TP rank 0 of the last pipeline stage.",
                              value=s.parallel_step_seconds)
    seconds = CounterMetricFamily("kvrelay:parallel_comm_seconds",
                                  "Communication time of TP rank 0 of the last stage, by kind (all_reduce, "
                                  "all_gather, send_recv; on CUDA launch time only).", labels=["kind"])
    nbytes = CounterMetricFamily("kvrelay:parallel_comm_bytes", "Bytes communicated by TP rank 0 of the last "
                                 "stage, by kind.", labels=["kind"])
    for kind in sorted(s.parallel_comm_seconds):
        seconds.add_metric([kind], s.parallel_comm_seconds[kind])
        nbytes.add_metric([kind], s.parallel_comm_bytes.get(kind, 0))
    yield seconds
    yield nbytes
    yield from rank_metrics(s)  # every rank's forward time


def expert_load_metrics(s):
    """Expert load balance of a mixture-of-experts model: routed tokens per expert (summed over the
    sparse layers) since start and in the last step, and the busiest expert over the mean."""
    if s.expert_load is None:
        return
    load = s.expert_load()
    total = CounterMetricFamily("kvrelay:moe_expert_tokens", "Tokens routed to each expert (all sparse layers).",
                                labels=["expert"])
    last = GaugeMetricFamily("kvrelay:moe_expert_tokens_last_step", "Tokens routed to each expert in the last step.",
                             labels=["expert"])
    for e, (t, n) in enumerate(zip(load.total, load.last_step, strict=True)):
        total.add_metric([str(e)], t)
        last.add_metric([str(e)], n)
    imbalance = GaugeMetricFamily("kvrelay:moe_expert_load_imbalance",
                                  "Busiest expert's tokens over the mean, worst sparse layer (1 = even).",
                                  labels=["window"])
    imbalance.add_metric(["last_step"], load.last_step_imbalance)
    imbalance.add_metric(["total"], load.total_imbalance)
    yield from (total, last, imbalance)


def spec_decode_metrics(s):
    """Speculative decoding counters, as vLLM names them (only when the engine speculates)."""
    if not s.spec_accepted_per_position:
        return
    for name, doc, value in (
        ("kvrelay:spec_decode_num_drafts", "Sequences-steps that carried proposed tokens.", s.spec_num_drafts),
        ("kvrelay:spec_decode_num_draft_tokens", "Tokens proposed.", s.spec_num_draft_tokens),
        ("kvrelay:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", s.spec_num_accepted_tokens),
        ("kvrelay:spec_decode_num_constrained_drafts", "Drafts for sequences with a grammar (structured output).",
         s.spec_num_constrained_drafts),
        ("kvrelay:spec_decode_num_constrained_accepted_tokens", "Proposed tokens accepted for sequences with a grammar.",
         s.spec_num_constrained_accepted_tokens),
        ("kvrelay:spec_decode_num_grammar_cut_tokens", "Proposed tokens the grammar rejected before verification.",
         s.spec_num_grammar_cut_tokens),
    ):
        yield CounterMetricFamily(name, doc, value=value)
    per_position = CounterMetricFamily("kvrelay:spec_decode_num_accepted_tokens_per_pos",
                                       "Proposed tokens accepted, by position in the proposal.", labels=["position"])
    for pos, value in enumerate(s.spec_accepted_per_position):
        per_position.add_metric([str(pos)], value)
    yield per_position


class WorkerMetrics:
    def __init__(self, engine=None):
        self.registry = r = CollectorRegistry()
        if engine is not None:
            r.register(EngineStatsCollector(engine))
        self.ttft = Histogram("kvrelay:time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvrelay:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvrelay:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.kv_seconds = Histogram("kvrelay:kv_transfer_seconds",
                                    "KV hand-off latency: first chunk received to last chunk written.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.kv_speed = Histogram("kvrelay:kv_transfer_speed_gb_s", "KV hand-off speed per request (GB/s).",
                                  buckets=SPEED_BUCKETS, registry=r)
        self.kv_send_seconds = Histogram(
            "kvrelay:kv_send_seconds",
            "Prefill side: KV hand-off from its start (the first layer-streamed chunk, or else the end of "
            "the prefill) to every chunk verified and written into the decode worker's cache: the time "
            "stamped in a doorbell ack (same node, one clock), else the stream ack's arrival.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.doorbell_ack_delay = Histogram(
            "kvrelay:kv_doorbell_ack_delay_seconds",
            "Prefill side: from the decode worker's write of a doorbell hand-off's last chunk to this "
            "worker reading its ack (the ack's way back, left out of kvrelay:kv_send_seconds).",
            buckets=LATENCY_BUCKETS, registry=r)
        self.kv_send_bytes = Counter("kvrelay:kv_send_bytes", "Prefill side: KV bytes acknowledged by decode "
                                     "workers.", registry=r)
        self.kv_bytes = Counter("kvrelay:kv_transfer_bytes", "KV bytes handed off.", registry=r)
        self.kv_overlap_bytes = Counter(
            "kvrelay:kv_transfer_overlapped_bytes",
            "KV bytes sent while the prefill was still computing (layer-wise streaming).", registry=r)
        self.kv_handoffs = Counter("kvrelay:kv_handoffs", "KV hand-offs by outcome.", ["outcome"], registry=r)
        self.lease_expiries = Counter("kvrelay:kv_lease_expiries", "Held KV leases that expired unacknowledged.",
                                      registry=r)
        self.aborts = Counter("kvrelay:kv_transfer_aborts", "Hand-offs aborted, by who asked.", ["reason"],
                              registry=r)
        self.fallbacks = Counter("kvrelay:kv_transfer_fallbacks",
                                 "Requests whose remote prefill failed: retried on another prefill worker "
                                 "(retry) or prefilled locally (local).", ["kind"], registry=r)
        self.shm_offers = Counter("kvrelay:kv_shm_offers",
                                  "Prefill side: shared-memory regions offered by decode workers, by whether "
                                  "this worker could open them (accepted) or sent the K/V inline (unreachable).",
                                  ["outcome"], registry=r)
        self.doorbells = Counter("kvrelay:kv_doorbell_handoffs",
                                 "Prefill side: shared-memory and CUDA IPC hand-offs whose decode worker offered a "
                                 "doorbell socket, by whether this worker reached it (connected) or signalled on gRPC (unreachable).",
                                 ["outcome"], registry=r)
        self.direct = Counter("kvrelay:kv_direct_handoffs",
                              "Prefill side: doorbell hand-offs whose decode worker copied the K/V straight out "
                              "of this worker's shared KV cache (--kv-shared-cache) instead of a region.",
                              registry=r)
        self.kv_plane_seconds = Histogram("kvrelay:kv_plane_transfer_seconds", "kvrelay:kv_transfer_seconds by "
                                          "data plane (grpc, shm, mooncake, cuda-ipc).", ["plane"],
                                          buckets=self.kv_seconds._upper_bounds[:-1], registry=r)
        self.kv_plane_bytes = Counter("kvrelay:kv_plane_transfer_bytes", "kvrelay:kv_transfer_bytes by data plane.",
                                      ["plane"], registry=r)
        self.plane_handoffs = Counter("kvrelay:kv_plane_handoffs", "Prefill side: hand-offs that took a fast "
                                      "data plane (mooncake, cuda-ipc).", ["plane"], registry=r)
        self.plane_fallbacks = Counter("kvrelay:kv_plane_fallbacks", "Hand-offs whose fast data plane "
                                       "(mooncake, cuda-ipc) could not open, so the K/V went inline on gRPC, by "
                                       "plane and reason.", ["plane", "reason"], registry=r)
        self.failures = Counter("kvrelay:kv_transfer_failures", "Failed hand-offs by reason.", ["reason"],
                                registry=r)

    def track_shm_arena(self, arena) -> None:
        """Decode side: free bytes of its shared-memory arena, read at scrape time."""
        Gauge("kvrelay:kv_shm_free_bytes", "Decode side: free bytes of the shared-memory K/V arena (all of "
              "it when no hand-off is in flight).", registry=self.registry).set_function(lambda: arena.free_bytes)

    def serve(self, port: int, host: str = "0.0.0.0"):
        """Serve /metrics on its own thread; returns the server (call .shutdown())."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
