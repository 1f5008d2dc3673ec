"""The gateway's admission queue: strict priority between bands, VTC fairness inside a band.

Requests take `slots` (sequences: n samples x prompts) of a fixed capacity that stands for
what the workers can run at once. When capacity is free a request goes straight through;
otherwise it waits here, which is what the queue-depth metric (the autoscaling signal)
counts. Dispatch picks the highest priority band with waiters, and inside it the tenant
with the smallest virtual token counter (VTC: tokens of service received). A tenant that
was idle joins at the smallest counter among the tenants already waiting, so idling banks
no credit and flooding earns no advantage. Counters are charged the estimated tokens at
dispatch and corrected to the real count at release.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Ticket:
    tenant_id: str
    priority: int
    cost: int  # estimated tokens (prompt + max_tokens x n), charged to the tenant's counter
    slots: int = 1
    rank: int = 0  # the request's own priority: higher leaves its tenant's queue first (FIFO among equals)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    granted: bool = False
    released: bool = False


class FairScheduler:
    def __init__(self, capacity: int, max_queue: int):
        if capacity < 1 or max_queue < 0:
            raise ValueError(f"capacity must be >= 1 and max_queue >= 0, got {capacity}, {max_queue}")
        self.capacity = capacity
        self.max_queue = max_queue
        self.inflight = 0
        self.depth = 0
        self._bands: dict[int, dict[str, deque[Ticket]]] = {}
        self._counters: dict[str, float] = {}

    def submit(self, tenant_id: str, priority: int, cost: int, slots: int = 1, rank: int = 0) -> Ticket:
        """Queue a request (or grant it at once); raises QueueFull past `max_queue` waiters. rank orders
        it among the same tenant's waiting requests only (fairness between tenants is unchanged)."""
        ticket = Ticket(tenant_id, priority, cost, slots, rank)
        if self.depth == 0 and self._fits(ticket):
            self._grant(ticket)
            return ticket
        if self.depth >= self.max_queue:
            raise QueueFull(f"gateway queue is full ({self.max_queue} requests waiting)")
        band = self._bands.setdefault(priority, {})
        waiting = band.get(tenant_id)
        if not waiting:
            others = [self._counters.get(t, 0.0) for t, q in band.items() if q]
            if others:
                self._counters[tenant_id] = max(self._counters.get(tenant_id, 0.0), min(others))
            band[tenant_id] = waiting = deque()
        at = len(waiting)
        while at and waiting[at - 1].rank < rank:
            at -= 1
        waiting.insert(at, ticket)
        self.depth += 1
        return ticket

    async def wait(self, ticket: Ticket) -> None:
        """Wait until the ticket is granted; on cancellation it leaves the queue."""
        try:
            await asyncio.shield(ticket.future)
        except asyncio.CancelledError:
            self.release(ticket)
            raise

    def release(self, ticket: Ticket, actual_cost: int | None = None) -> None:
        """Free a granted ticket's slots, or withdraw a waiting one. Idempotent."""
        if ticket.released:
            return
        ticket.released = True
        if ticket.granted:
            self.inflight -= ticket.slots
            if actual_cost is not None:
                self._counters[ticket.tenant_id] = self._counters.get(ticket.tenant_id, 0.0) + (
                    actual_cost - ticket.cost)
        else:
            queue = self._bands.get(ticket.priority, {}).get(ticket.tenant_id)
            if queue is not None and ticket in queue:
                queue.remove(ticket)
                self.depth -= 1
            if not ticket.future.done():
                ticket.future.cancel()
        self._dispatch()

    def _fits(self, ticket: Ticket) -> bool:
        # A request wider than the whole capacity still runs, alone.
        return self.inflight + ticket.slots <= self.capacity or self.inflight == 0

    def _grant(self, ticket: Ticket) -> None:
        ticket.granted = True
        self.inflight += ticket.slots
        self._counters[ticket.tenant_id] = self._counters.get(ticket.tenant_id, 0.0) + ticket.cost
        if not ticket.future.done():
            ticket.future.set_result(None)

    def _dispatch(self) -> None:
        while self.depth:
            priority = max(p for p, band in self._bands.items() if any(band.values()))
            band = self._bands[priority]
            tenant = min((t for t, q in band.items() if q), key=lambda t: self._counters.get(t, 0.0))
            ticket = band[tenant][0]
            if not self._fits(ticket):
                return
            band[tenant].popleft()
            if not band[tenant]:
                del band[tenant]
            self.depth -= 1
            self._grant(ticket)

    def waiting_by_tenant(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for band in self._bands.values():
            for tenant, q in band.items():
                counts[tenant] = counts.get(tenant, 0) + len(q)
        return counts
