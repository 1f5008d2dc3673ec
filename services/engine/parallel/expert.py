"""Expert parallelism: which experts this rank holds, and the collective that combines the ranks'
partial MoE outputs.

Every rank runs attention replicated (or tensor-parallel) over the same tokens, so each already
has every token's hidden state and routing: a rank runs its own experts on the tokens routed to
them, and one all-reduce over the EP group sums the ranks' partial outputs (each token's top-k
contributions live on the ranks that hold those experts). That is the all-gather + reduce-scatter
of the token dispatch with the gather already done; an all-to-all that moves only routed tokens
pays off once attention is data-parallel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.parallel.state import get_parallel_state


def local_experts(num_experts: int) -> range:
    """The global ids of the experts this rank holds: a contiguous 1/ep share."""
    state = get_parallel_state()
    ep = state.ep_size
    if num_experts % ep:
        raise ModelLoadError(
            f"num_experts {num_experts} is not divisible by the expert-parallel size {ep} "
            f"(--enable-expert-parallel uses the tensor-parallel size): pick a size that divides it"
        )
    per_rank = num_experts // ep
    return range(state.ep_rank * per_rank, (state.ep_rank + 1) * per_rank)


def ep_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums the ranks' partial MoE outputs in place; free when experts are not split."""
    state = get_parallel_state()
    if state.ep_size > 1:
        dist.all_reduce(x, group=state.ep_group)
    return x
