"""Per-rank forward times under TP=2 x PP=2 (four gloo processes): every rank reports its own
forward time and communication with its step reply, and /metrics has a histogram per rank whose
count is the steps run, the per-step skew beside it, and each rank's communication by kind."""

from __future__ import annotations

from helpers import make_engine
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.metrics import WorkerMetrics
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.models import BUNDLED_MODEL


def _scrape(registry) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def _forward(samples, suffix: str) -> dict[tuple, float]:
    return {labels: v for (name, labels), v in samples.items()
            if name == f"kvrelay:parallel_rank_forward_seconds_{suffix}"}


def test_every_rank_reports_its_forward_time_per_step():
    engine = make_engine(BUNDLED_MODEL, tensor_parallel_size=2, pipeline_parallel_size=2, kv_cache_memory=4 << 20)
    try:
        registry = WorkerMetrics(engine).registry
        assert not _forward(_scrape(registry), "count")  # no step yet: no series
        engine.add_request("Once upon a time", SamplingParams(max_tokens=3, min_tokens=3, temperature=0.0), "a")
        while engine.has_work():
            engine.step()
        first = _scrape(registry)
        counts, sums = _forward(first, "count"), _forward(first, "sum")
        want = {(("pp_rank", str(r // 2)), ("rank", str(r)), ("tp_rank", str(r % 2))) for r in range(4)}
        assert set(counts) == want
        steps = engine.stats().parallel_steps
        assert steps >= 3 and all(c == steps for c in counts.values())
        assert all(v > 0 for v in sums.values())
        assert first["kvrelay:parallel_rank_skew_seconds_count", ()] == steps
        # each rank's own communication: TP all-reduces on every rank, send/recv between the stages
        comm = {(dict(k)["rank"], dict(k)["kind"]): v for (n, k), v in first.items()
                if n == "kvrelay:parallel_rank_comm_bytes_total"}
        assert all(comm[str(r), "all_reduce"] > 0 and comm[str(r), "send_recv"] > 0 for r in range(4))
        assert all(comm[str(r), "all_gather"] > 0 for r in (2, 3)) and (str(0), "all_gather") not in comm
        # a bucket per rank: the +Inf bucket holds every step
        inf = {k: v for (n, k), v in first.items() if n == "kvrelay:parallel_rank_forward_seconds_bucket"
               and ("le", "+Inf") in k}
        assert sorted(inf.values()) == [steps] * 4

        engine.add_request("Lily", SamplingParams(max_tokens=2, min_tokens=2, temperature=0.0), "b")
        while engine.has_work():
            engine.step()
        later = _forward(_scrape(registry), "count")
        assert all(later[k] > counts[k] for k in want)
    finally:
        engine.close()
