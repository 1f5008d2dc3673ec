"""This process's place in the parallel layout, and the collectives the model calls.

The model reads its rank and group from here, never from the scheduler or a request, so the same
layer code runs in one process (every size 1, every collective a no-op) and in N×M worker
processes started by the executor. Expert parallelism reuses the tensor-parallel group, as vLLM
does: with `enable_expert_parallel`, the TP ranks hold disjoint experts instead of expert slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelConfig:
    """What the user asked for (`--tensor-parallel-size`, `--pipeline-parallel-size`,
    `--enable-expert-parallel`)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class ParallelState:
    """This process's ranks and groups. A group of None means size 1: nothing to communicate."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    expert_parallel: bool = False

    @property
    def ep_rank(self) -> int:
        return self.tp_rank if self.expert_parallel else 0

    @property
    def ep_size(self) -> int:
        return self.tp_size if self.expert_parallel else 1

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return self.tp_group if self.expert_parallel else None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_state = ParallelState()


def get_parallel_state() -> ParallelState:
    return _state


def set_parallel_state(state: ParallelState) -> None:
    """Called once per worker process by the executor, before the model is built."""
    global _state
    _state = state


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the tensor-parallel ranks in place (row-parallel outputs); free at TP=1."""
    state = _state
    if state.tp_size > 1:
        dist.all_reduce(x, group=state.tp_group)
    return x
