"""Per-rank forward times of the tensor/pipeline-parallel workers, and the skew between ranks.

Every rank measures its own forward of each step (its layers and its collectives, not the time it
waits for the previous pipeline stage's hidden states) and sends it with its step reply; the driver
keeps one histogram per rank and one of the per-step skew (slowest rank minus fastest), exported as
`kvrelay:parallel_rank_forward_seconds{rank,tp_rank,pp_rank}` and `kvrelay:parallel_rank_skew_seconds`,
and each rank's communication totals, `kvrelay:parallel_rank_comm_{seconds,bytes}{rank,...,kind}`.
A rank that is always the slowest points at a straggling GPU, host or link.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field

import torch
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

FORWARD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histo:
    """Counts per bucket (upper bounds FORWARD_BUCKETS, then +Inf), their sum and count."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(FORWARD_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(FORWARD_BUCKETS, value)] += 1
        self.total += value
        self.count += 1

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative (le, count) pairs, as Prometheus histograms have them."""
        out, running = [], 0
        for bound, n in zip((*map(str, FORWARD_BUCKETS), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    def copy(self) -> Histo:
        return Histo(list(self.counts), self.total, self.count)


@dataclass
class RankTimes:
    """One rank's forward times, and its communication totals by kind (seconds, bytes)."""

    rank: int
    tp_rank: int
    pp_rank: int
    forward: Histo = field(default_factory=Histo)
    comm_s: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, int] = field(default_factory=dict)

    def copy(self) -> RankTimes:
        return RankTimes(self.rank, self.tp_rank, self.pp_rank, self.forward.copy(), dict(self.comm_s),
                         dict(self.comm_bytes))


class ForwardTimer:
    """One rank's forward time per step. On CPU: the wall clock, less the wait for the previous
    stage. On CUDA: the GPU's time between an event after the receive (or at the start) and one at
    the end, read one step late, when it is long done, so that no step waits for the GPU for it
    (the first step reports None)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pending = None
        self._started = self._waited = 0.0
        self._begin = None

    def start(self) -> None:
        self._started, self._waited = time.perf_counter(), 0.0
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()

    def received(self, waited: float) -> None:
        """The previous stage's hidden states arrived (on CUDA: their receive is enqueued)."""
        self._waited = waited
        if self.cuda:
            self._begin.record()  # again: the GPU passes it once the receive is done

    def stop(self) -> float | None:
        if not self.cuda:
            return time.perf_counter() - self._started - self._waited
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        last, self._pending = self._pending, (self._begin, end)
        if last is None:
            return None
        last[1].synchronize()
        return last[0].elapsed_time(last[1]) / 1000.0


class RankStats:
    """The driver's record of every rank's forward times (see the module doc)."""

    def __init__(self, tp: int, pp: int):
        self.ranks = [RankTimes(r, r % tp, r // tp) for r in range(tp * pp)]
        self.skew = Histo()

    def add_step(self, forward_s: list[float | None], comm: list[dict[str, tuple[float, int]]]) -> None:
        """One step's forward seconds and communication by kind, indexed by rank (a forward time of
        None: not measured, left out of the histograms)."""
        for times, kinds in zip(self.ranks, comm, strict=True):
            for kind, (sec, nbytes) in kinds.items():
                times.comm_s[kind] = times.comm_s.get(kind, 0.0) + sec
                times.comm_bytes[kind] = times.comm_bytes.get(kind, 0) + nbytes
        if None in forward_s:
            return
        for times, sec in zip(self.ranks, forward_s, strict=True):
            times.forward.observe(sec)
        self.skew.observe(max(forward_s) - min(forward_s))

    def snapshot(self) -> dict:
        return {"parallel_ranks": [r.copy() for r in self.ranks], "parallel_skew": self.skew.copy()}


def rank_metrics(s):
    """Prometheus families from EngineStats' parallel_ranks and parallel_skew (nothing in one process)."""
    ranks = getattr(s, "parallel_ranks", None)
    if not ranks:
        return
    forward = HistogramMetricFamily(
        "kvrelay:parallel_rank_forward_seconds",
        "Each tensor/pipeline-parallel rank's forward time per step (its layers and collectives, not its "
        "wait for the previous stage).", labels=["rank", "tp_rank", "pp_rank"])
    for r in ranks:
        forward.add_metric([str(r.rank), str(r.tp_rank), str(r.pp_rank)], r.forward.buckets(), r.forward.total)
    yield forward
    seconds = CounterMetricFamily("kvrelay:parallel_rank_comm_seconds", "Each rank's communication time by kind "
                                  "(all_reduce, all_gather, send_recv; on CUDA launch time only).",
                                  labels=["rank", "tp_rank", "pp_rank", "kind"])
    nbytes = CounterMetricFamily("kvrelay:parallel_rank_comm_bytes", "Each rank's bytes communicated by kind.",
                                 labels=["rank", "tp_rank", "pp_rank", "kind"])
    for r in ranks:
        for kind in sorted(r.comm_s):
            labels = [str(r.rank), str(r.tp_rank), str(r.pp_rank), kind]
            seconds.add_metric(labels, r.comm_s[kind])
            nbytes.add_metric(labels, r.comm_bytes.get(kind, 0))
    yield seconds
    yield nbytes
    skew = HistogramMetricFamily("kvrelay:parallel_rank_skew_seconds",
                                 "Per step: the slowest rank's forward time minus the fastest's.")
    skew.add_metric([], s.parallel_skew.buckets(), s.parallel_skew.total)
    yield skew
