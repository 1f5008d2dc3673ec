"""Where a disaggregated request's time goes, stage by stage (benchmarks/gpu_handoff.py).

For a few traced requests, the methods that mark each stage of a hand-off are wrapped to record
when they are entered and left (time.perf_counter(), one clock: every worker is in this process).
Each stage's median is printed in ms from the client's call, so "TTFT beyond the compute" can be
read hop by hop: the decode side's pull and reservation (side by side with an early start), the
prefill stream's start, the prefill step, the rings, the decode side's copy and check, the
activation and the first output. (The prefill
step's end is the first ring's start: its after_step hook is bound before tracing.) The wrappers
cost a few microseconds per stage and are removed after the traced requests.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import statistics
import time

# (module, class or None, function, label, exits): its first entry ">" and, if exits, its last
# exit "<" (the prefill worker rings once per streamed layer group, then once more).
STAGES = (
    ("kvrelay.decode.worker", "DecodeWorker", "_load_kv", "decode: pull", True),
    ("kvrelay.engine.llm_engine", "LLMEngine", "reserve", "decode: reserve", True),
    ("kvrelay.kvtransfer.transport", "GrpcKVTransport", "_run", "decode: hand-off stream", True),
    ("kvrelay.prefill.worker", "PrefillWorker", "_compute", "prefill: compute", True),
    ("kvrelay.prefill.engine_side", "EngineThreadSide", "_ring_frames", "prefill: ring", True),
    ("kvrelay.kvtransfer.doorbell", "DoorbellServer", "_on_frame", "decode: doorbell frame", True),
    ("kvrelay.engine.llm_engine", "LLMEngine", "activate", "decode: activate", True),
    ("kvrelay.decode.worker", None, "output_to_proto", "decode: first output", False),
)


class Tracer:
    def __init__(self, exclude: set[str] = frozenset()):
        self.stages = [stage for stage in STAGES if stage[3] not in exclude]  # by label
        self.events: list[tuple[str, float]] = []
        self.rows: list[dict[str, float]] = []

    @contextlib.contextmanager
    def installed(self):
        import importlib

        undo = []
        for module, cls, name, label, exits in self.stages:
            owner = importlib.import_module(module)
            if cls is not None:
                owner = getattr(owner, cls)
            original, own = getattr(owner, name), name in vars(owner)  # else inherited (a mixin's)
            setattr(owner, name, self._wrap(original, label, exits))
            undo.append((owner, name, original, own))
        try:
            yield self
        finally:
            for owner, name, original, own in undo:
                if own:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)

    def _wrap(self, fn, label: str, exits: bool):
        events = self.events

        def left() -> None:
            if exits:
                events.append((label + " <", time.perf_counter()))

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def traced(*a, **k):
                events.append((label + " >", time.perf_counter()))
                try:
                    return await fn(*a, **k)
                finally:
                    left()
        else:
            @functools.wraps(fn)
            def traced(*a, **k):
                events.append((label + " >", time.perf_counter()))
                try:
                    return fn(*a, **k)
                finally:
                    left()
        return traced

    def start(self) -> float:
        self.events.clear()
        return time.perf_counter()

    def record(self, started: float, ttft_s: float) -> None:
        """One traced request: each stage's first entry and last exit, from the client's call."""
        row: dict[str, float] = {}
        for label, at in self.events:
            if label.endswith(">"):
                row.setdefault(label, (at - started) * 1e3)
            else:
                row[label] = (at - started) * 1e3
        row["client: first token"] = ttft_s * 1e3
        self.rows.append(row)

    def medians(self) -> list[tuple[str, float]]:
        keys = {k for r in self.rows for k in r}
        out = [(k, statistics.median(r[k] for r in self.rows if k in r)) for k in keys]
        return sorted(out, key=lambda kv: kv[1])
