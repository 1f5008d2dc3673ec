"""What the API process and the engine-core process send each other over ZeroMQ.

Each message is one pickled tuple whose first item names it. Pickle rather than msgpack:
benchmarks/engine_ipc.py measures pickle encoding and decoding a step's RequestOutputs about 2x
faster than msgpack plus the conversion dataclasses need, and both ends are the same kvrelay
install, talking over Unix sockets in a directory only this user can open.

API -> engine:
    ("add", request_id, prompt, SamplingParams, priority, cache_salt)
    ("abort", request_id)     the engine ends the request with finish_reason "abort"
    ("cancel", request_id)    the caller stopped reading: drop it, free its blocks, send nothing
    ("lora", op_id, "load" | "unload", name, path)   a LoRA adapter loaded or unloaded at run time
    ("shutdown",)
engine -> API:
    ("ready", EngineInfo)     once, first
    ("outs", [RequestOutput, ...])   a step's outputs, batched
    ("error", request_id, EngineError)   the request was refused before scheduling
    ("stats", EngineStats)    when they changed, at most every STATS_INTERVAL_S
    ("fatal", message)        the step loop died; the process exits next
    ("lora_done", op_id, None | (http_status, message))   the "lora" operation's outcome
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from typing import Any

from kvrelay.engine.outputs import EngineStats
from kvrelay.engine.sampling_params import SamplingParams

STATS_INTERVAL_S = 0.1


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    max_model_len: int
    default_sampling_params: SamplingParams
    pid: int
    pooler: Any = None  # an embedding or classification model's PoolerConfig; None: it generates


@dataclass(frozen=True)
class Snapshot:
    """A value read in the engine process, standing in for EngineStats' callables (the MoE expert
    load, read at scrape time in one process), which do not cross a process boundary."""

    value: Any

    def __call__(self) -> Any:
        return self.value


def picklable_stats(stats: EngineStats) -> EngineStats:
    if stats.expert_load is None:
        return stats
    return dataclasses.replace(stats, expert_load=Snapshot(stats.expert_load()))


def encode(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> tuple:
    return pickle.loads(data)  # our own child, on a socket only this user can open
