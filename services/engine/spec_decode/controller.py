"""Whether a step speculates at all: chosen by measured throughput, per batch size.

Speculation pays when verifying K extra tokens per sequence costs less than the accepted tokens
save. That depends on the model, the device, the batch and the acceptance of the workload, so no
fixed threshold holds everywhere (on CPU with a tiny model, per-sequence host work dominates and a
batch of 16 runs slower with proposals; on a GPU the same batch is memory-bound and gains). The
controller measures instead: for each batch-size bucket it keeps the tokens/s of the last WINDOW
decode-only steps with and without speculation and compares their medians (a step stalled by
another process on a busy machine moves a median little, where it would dominate a mean), tries each
mode MIN_SAMPLES times, then runs the faster one and now and then a step of the other, so that the
estimate follows the workload. Exploring costs what the losing mode is
slower by, so it is spaced to cost at most EXPLORE_COST of throughput: at least EXPLORE_EVERY steps
apart, (1 - rate ratio) / EXPLORE_COST when that is more (a mode at half the rate: one step in 50),
and never more than MAX_EXPLORE_EVERY, so that a workload that changes is still noticed.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

EXPLORE_EVERY = 8  # fewest steps per bucket between tries of the mode that currently loses
EXPLORE_COST = 0.01  # the throughput exploring may cost
MAX_EXPLORE_EVERY = 128
MIN_SAMPLES = 3  # measured steps of each mode before the faster one is chosen
WINDOW = 16  # recent steps per mode whose median rate is compared


@dataclass
class _Bucket:
    # speculate? -> tokens/s of its last WINDOW measured steps
    recent: dict[bool, deque] = field(default_factory=lambda: {m: deque(maxlen=WINDOW) for m in (True, False)})
    samples: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    steps: int = 0

    def rate(self, mode: bool) -> float:
        return statistics.median(self.recent[mode]) if self.recent[mode] else 0.0

    def faster(self) -> bool | None:
        """The faster mode, or None while either has fewer than MIN_SAMPLES measured steps."""
        if min(self.samples.values()) < MIN_SAMPLES:
            return None
        return self.rate(True) >= self.rate(False)


def explore_every(ratio: float) -> int:
    """Steps between tries of a mode that runs at `ratio` of the faster one's rate."""
    return min(MAX_EXPLORE_EVERY, max(EXPLORE_EVERY, math.ceil((1.0 - ratio) / EXPLORE_COST)))


class SpecController:
    def __init__(self):
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def _key(batch: int) -> int:
        return 1 << (batch - 1).bit_length()  # 1, 2, 4, 8, ...

    def should_speculate(self, batch: int) -> bool:
        b = self._buckets.setdefault(self._key(batch), _Bucket())
        b.steps += 1
        best = b.faster()
        if best is None:  # speculation first, then plain, until both have their samples
            return b.samples[True] < MIN_SAMPLES
        every = explore_every(b.rate(not best) / b.rate(best) if b.rate(best) else 1.0)
        return (not best) if b.steps % every == 0 else best

    def preferred(self, batch: int) -> bool:
        """The faster mode so far, for steps that are not measured (they carry prefill chunks)."""
        b = self._buckets.get(self._key(batch))
        best = b.faster() if b is not None else None
        return True if best is None else best

    def record(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One decode-only step's outcome: tokens emitted in `seconds` of step time."""
        if seconds <= 0:
            return
        b = self._buckets.setdefault(self._key(batch), _Bucket())
        b.recent[speculated].append(tokens / seconds)
        b.samples[speculated] += 1

    def rates(self) -> dict[int, dict[bool, float]]:
        return {k: {m: b.rate(m) for m in (True, False)} for k, b in self._buckets.items()}
