"""Whether a step speculates at all: chosen by measured throughput, per batch size.

Speculation pays when verifying K extra tokens per sequence costs less than the accepted tokens
save. That depends on the model, the device, the batch and the acceptance of the workload, so no
fixed threshold holds everywhere (on CPU with a tiny model, per-sequence host work dominates and a
batch of 16 runs slower with proposals; on a GPU the same batch is memory-bound and gains). The
controller measures instead: for each batch-size bucket it keeps a moving average of tokens emitted
per second of decode-only steps with and without speculation, runs the faster mode, and spends one
step in EXPLORE_EVERY on the other mode so that the estimate follows the workload.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXPLORE_EVERY = 16  # steps per bucket between tries of the mode that currently loses
SMOOTHING = 0.2  # weight of the newest step in the moving average


@dataclass
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # speculate? -> tokens per second
    steps: int = 0


class SpecController:
    def __init__(self):
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def _key(batch: int) -> int:
        return 1 << (batch - 1).bit_length()  # 1, 2, 4, 8, ...

    def should_speculate(self, batch: int) -> bool:
        b = self._buckets.setdefault(self._key(batch), _Bucket())
        b.steps += 1
        if True not in b.rate:
            return True
        if False not in b.rate:
            return False
        best = b.rate[True] >= b.rate[False]
        return (not best) if b.steps % EXPLORE_EVERY == 0 else best

    def preferred(self, batch: int) -> bool:
        """The faster mode so far, for steps that are not measured (they carry prefill chunks)."""
        b = self._buckets.get(self._key(batch))
        if b is None or True not in b.rate or False not in b.rate:
            return True
        return b.rate[True] >= b.rate[False]

    def record(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One decode-only step's outcome: tokens emitted in `seconds` of step time."""
        if seconds <= 0:
            return
        b = self._buckets.setdefault(self._key(batch), _Bucket())
        rate = tokens / seconds
        old = b.rate.get(speculated)
        b.rate[speculated] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate

    def rates(self) -> dict[int, dict[bool, float]]:
        return {k: dict(b.rate) for k, b in self._buckets.items()}
