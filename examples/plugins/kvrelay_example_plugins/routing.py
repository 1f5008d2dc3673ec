"""round_robin: each role's live workers in turn, ignoring load and cache affinity (a baseline
to compare the built-in policy with; `kvrelay gateway --routing-policy round_robin`)."""

from __future__ import annotations

import itertools


class RoundRobin:
    def __init__(self):
        self.turns = {"prefill": itertools.count(), "decode": itertools.count()}
        self.picked: list[tuple[str, str]] = []  # (role, address), kept for the example's test

    def pick(self, role: str, workers: list, hashes: list[int]):
        ordered = sorted(workers, key=lambda w: w.address)
        choice = ordered[next(self.turns[role]) % len(ordered)]
        self.picked.append((role, choice.address))
        return choice
