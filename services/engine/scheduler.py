"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

Each step first gives running sequences their next tokens (one for a decode, a chunk for a
prefill still in progress), then admits waiting sequences while budget, sequence slots and
KV blocks last. When blocks run out, the worst sequence (lowest priority, then newest) is
preempted by recompute: its blocks are freed (full ones stay in the prefix cache) and it
goes back to the waiting queue with every token it generated, so no request is lost.

With a sliding window on every layer, a running sequence's leading blocks that no later query
can see (wholly before its window) go back to the pool: its table keeps their stale ids, which
the attention kernels never read, and num_dropped says how many lead it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvrelay.engine.block_pool import BlockPool, hash_block
from kvrelay.engine.sequence import Sequence, Status


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"  # "fcfs" | "priority" (higher priority value runs first)
    block_size: int = 16
    # Every layer attends to at most this many tokens: blocks wholly before it are freed. None: keep all.
    sliding_window: int | None = None


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    num_new: list[int]


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        if config.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {config.policy!r}")
        self.config = config
        self.pool = pool
        self.bs = config.block_size
        self.waiting: list[Sequence] = []  # sorted by _key
        self.running: list[Sequence] = []  # sorted by _key
        self.num_preemptions = 0

    def _key(self, seq: Sequence) -> tuple[int, int]:
        if self.config.policy == "priority":
            return (-seq.priority, seq.seq_id)
        return (0, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=self._key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- blocks ---------------------------------------------------------------------------

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = seq.num_computed + num_new
        return max(0, -(-total // self.bs) - len(seq.block_table))

    def try_allocate(self, seq: Sequence, num_new: int) -> bool:
        """Blocks for num_new more tokens of seq if the pool has them now (never preempts)."""
        return self._try_allocate(seq, num_new)

    def _try_allocate(self, seq: Sequence, num_new: int) -> bool:
        need = self._blocks_needed(seq, num_new)
        if need > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def ensure_hashes(self, seq: Sequence, num_blocks: int) -> None:
        while len(seq.block_hashes) < num_blocks:
            k = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if k else seq.cache_root
            a, b = k * self.bs, (k + 1) * self.bs
            images = seq.images  # placeholders hash as their image (kvrelay.engine.multimodal.inputs.cache_keys)
            tokens = seq.token_ids[a:b] if images is None or a >= len(images.keys) else (
                list(images.keys[a:b]) + seq.token_ids[len(images.keys) : b])
            seq.block_hashes.append(hash_block(parent, tokens))

    def _take_cached_prefix(self, seq: Sequence) -> None:
        # At least the last token must be computed to produce logits.
        full = (seq.num_tokens - 1) // self.bs
        self.ensure_hashes(seq, full)
        blocks = self.pool.lookup(seq.block_hashes[:full], seq.num_tokens, self.bs)
        seq.block_table = blocks
        seq.num_computed = len(blocks) * self.bs
        seq.num_registered = len(blocks)
        if not seq.first_admitted:
            seq.num_cached_tokens = min(seq.num_computed, seq.prompt_len)

    def register_full_blocks(self, seq: Sequence) -> None:
        full = seq.num_computed // self.bs
        if full <= seq.num_registered:
            return
        self.ensure_hashes(seq, full)
        for k in range(seq.num_registered, full):
            self.pool.register(seq.block_table[k], seq.block_hashes[k])
        seq.num_registered = full

    def free_blocks(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table[seq.num_dropped :])
        seq.block_table = []
        seq.num_dropped = 0
        seq.table_epoch += 1
        seq.num_computed = 0
        seq.num_registered = 0

    def drop_out_of_window(self, seq: Sequence) -> None:
        """Free the leading blocks no later query of seq can see. The next query sits at position
        num_computed and sees keys after num_computed - window. A P/D hand-off reads every block
        of a held sequence, so those keep theirs; full blocks stay in the prefix cache."""
        window = self.config.sliding_window
        if window is None or seq.hold_blocks:
            return
        dead = max(0, seq.num_computed - window + 1) // self.bs
        if dead > seq.num_dropped:
            self.pool.free(seq.block_table[seq.num_dropped : dead])
            seq.num_dropped = dead

    # ---- scheduling -------------------------------------------------------------------------

    def _preempt(self, seq: Sequence, scheduled: dict[Sequence, int]) -> int:
        """Recompute-preempt seq; returns the token budget it gives back."""
        refund = scheduled.pop(seq, 0)
        self.running.remove(seq)
        self.free_blocks(seq)
        self.num_preemptions += 1
        self.add(seq)
        return refund

    def _lower_priority_victim(self, seq: Sequence) -> Sequence | None:
        """Priority policy: the worst running sequence of strictly lower priority than seq."""
        if self.config.policy != "priority":
            return None
        victims = [r for r in self.running if r.priority < seq.priority]
        return max(victims, key=self._key) if victims else None

    def schedule(self) -> ScheduledStep:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        preempted = False

        windowed = self.config.sliding_window is not None
        bs = self.bs
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            if windowed:
                self.drop_out_of_window(seq)
            # len(token_ids), not the property: this loop runs per sequence per step.
            num_new = min(len(seq.token_ids) - seq.num_computed, budget)
            if num_new <= 0:
                continue
            if seq.num_computed + num_new <= len(seq.block_table) * bs:  # most decodes: room left
                scheduled[seq] = num_new
                budget -= num_new
                continue
            while not self._try_allocate(seq, num_new):
                victim = max(self.running, key=self._key)
                budget += self._preempt(victim, scheduled)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled[seq] = num_new
                budget -= num_new

        # Admit waiting sequences, unless this step already had to preempt.
        i = 0
        while not preempted and i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            if seq.blocked():
                i += 1
                continue
            if len(self.running) >= self.config.max_num_seqs:
                victim = self._lower_priority_victim(seq)
                if victim is None:
                    break
                budget += self._preempt(victim, scheduled)
                i = self.waiting.index(seq)
                continue
            if not seq.block_table:
                self._take_cached_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            if not self._try_allocate(seq, num_new):
                victim = self._lower_priority_victim(seq)
                if victim is not None:
                    budget += self._preempt(victim, scheduled)
                    i = self.waiting.index(seq)
                    continue
                self.free_blocks(seq)  # give back the prefix-cache references taken above
                break
            self.waiting.pop(i)
            seq.first_admitted = True
            self.insert_running(seq)
            scheduled[seq] = num_new
            budget -= num_new

        seqs = list(scheduled)
        return ScheduledStep(seqs=seqs, num_new=[scheduled[s] for s in seqs])

    def insert_running(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=self._key)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Mark finished and free blocks at once (unless the P/D hand-off holds them)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if not seq.hold_blocks:
            self.free_blocks(seq)
