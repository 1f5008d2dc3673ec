"""Choosing workers in the disaggregated mode: discovery, liveness, prefill and decode choice.

- Discovery: a static list (`--prefill a:1,b:2`) or a headless Service name
  (`dns:///kvrelay-prefill.ns.svc:50051`) re-resolved every few seconds; members that appear
  or vanish are picked up without a restart.
- Liveness: each worker streams its load to the gateway; a worker whose last report is older
  than `eject_after_s` (1 s) is not chosen until it reports again.
- Prefill choice: prefix-cache affinity. When workers publish the block hashes they hold, the
  worker holding the longest leading run of the prompt's blocks wins (unless overloaded).
  Otherwise the prompt's leading block hash picks a worker by consistent hashing with bounded
  load, so the same prefix keeps landing where its KV is cached while no worker takes more
  than `load_bound` x the average load.
- Node pairing: for a decode worker that offers a shared-memory arena (`--kv-shm-bytes`), a
  prefill worker on its node (both publish `node`) comes next after prefix-cache affinity, so
  the K/V skips the network; only such a worker under the load bound qualifies.
- Decode choice: prefix-cache affinity first (a conversation's next turn goes back to the decode
  worker that generated the last answer, which holds it all but the new message and so pulls only
  the rest of the K/V), while under the load bound; otherwise by load (waiting, running, free
  KV blocks).
- Retry: the caller passes the workers that already failed this request in `exclude`.

Block hashes chain like the engine's prefix cache: hash(parent hash, the block's token ids).
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

VIRTUAL_NODES = 64


def block_hashes(token_ids: list[int], block_size: int, max_blocks: int = 64) -> list[int]:
    """Chained hashes of the prompt's leading full blocks."""
    hashes, parent = [], b""
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        block = token_ids[start:start + block_size]
        digest = hashlib.blake2b(parent + b"|" + ",".join(map(str, block)).encode(), digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        parent = digest
    return hashes


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@dataclass
class Worker:
    address: str  # host:port
    role: str  # "prefill" | "decode"
    last_report: float = 0.0  # time.monotonic() of the last load report; 0: never
    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    cached_blocks: set[int] = field(default_factory=set)  # block hashes the worker published
    inflight: int = 0  # requests this gateway has on it now
    node: str = ""  # the node it runs on, as published; "" when unknown
    kv_shm: bool = False  # decode: offers a shared-memory arena to prefill workers on its node

    @property
    def load(self) -> int:
        return self.num_waiting + self.num_running + self.inflight


class WorkerPool:
    def __init__(self, role: str, eject_after_s: float = 1.0, load_bound: float = 1.25,
                 clock: Callable[[], float] = time.monotonic, policy: object | None = None):
        self.role = role
        # A routing-policy plugin (kvrelay.gateway.routing_policy) choosing among the live
        # candidates instead of the built-in rules below; None: the built-in rules.
        self.policy = policy
        self.eject_after_s = eject_after_s
        self.load_bound = load_bound
        self.clock = clock
        self.workers: dict[str, Worker] = {}
        self._ring: list[tuple[int, str]] = []

    # -- membership and liveness

    def set_members(self, addresses: Iterable[str]) -> None:
        wanted = set(addresses)
        for gone in set(self.workers) - wanted:
            log.info("%s worker %s left", self.role, gone)
            del self.workers[gone]
        for new in wanted - set(self.workers):
            log.info("%s worker %s joined", self.role, new)
            self.workers[new] = Worker(new, self.role)
        self._ring = sorted((_point(f"{a}#{i}"), a) for a in self.workers for i in range(VIRTUAL_NODES))

    def report(self, address: str, *, num_waiting: int, num_running: int, kv_blocks_free: int,
               kv_blocks_total: int, cached_blocks: Iterable[int] | None = None, node: str = "",
               kv_shm: bool = False) -> None:
        """A load report from a worker's stream; it also proves the worker is alive."""
        w = self.workers.get(address)
        if w is None:
            return
        w.last_report = self.clock()
        w.num_waiting, w.num_running = num_waiting, num_running
        w.kv_blocks_free, w.kv_blocks_total = kv_blocks_free, kv_blocks_total
        w.node, w.kv_shm = node, kv_shm
        if cached_blocks is not None:
            w.cached_blocks = set(cached_blocks)

    def live(self, exclude: Iterable[str] = ()) -> list[Worker]:
        now, skip = self.clock(), set(exclude)
        return [w for w in self.workers.values()
                if w.address not in skip and w.last_report and now - w.last_report <= self.eject_after_s]

    # -- choice

    def _bound(self, candidates: list[Worker]) -> int:
        total = sum(w.load for w in candidates) + 1  # counting the request being placed
        return max(1, math.ceil(self.load_bound * total / len(candidates)))

    def pick_prefill(self, hashes: list[int], exclude: Iterable[str] = (), node: str = "") -> Worker | None:
        """node: the chosen decode worker's node when it offers shared memory ("" otherwise)."""
        candidates = self.live(exclude)
        if not candidates:
            return None
        if self.policy is not None:
            return self.policy.pick(self.role, candidates, list(hashes))
        bound = self._bound(candidates)
        # 1. published caches: the longest leading run of the prompt's blocks
        best = _longest_cached_prefix(candidates, hashes, bound)
        if best is not None:
            return best
        # 2. the decode worker's node, where the K/V goes through shared memory
        if node:
            local = [w for w in candidates if w.node == node and w.load < bound]
            if local:
                return min(local, key=lambda w: (w.load, w.address))
        # 3. consistent hashing on the leading block, skipping workers over the load bound
        if hashes:
            allowed = {w.address: w for w in candidates}
            start = bisect.bisect(self._ring, (hashes[0] & (2**64 - 1), ""))
            for i in range(len(self._ring)):
                address = self._ring[(start + i) % len(self._ring)][1]
                w = allowed.get(address)
                if w is not None and w.load < bound:
                    return w
        # 4. no prefix to be affine to (or everyone over the bound): least loaded
        return min(candidates, key=lambda w: (w.load, w.address))

    def pick_decode(self, hashes: list[int] = (), exclude: Iterable[str] = ()) -> Worker | None:
        candidates = self.live(exclude)
        with_room = [w for w in candidates if w.kv_blocks_free > 0] or candidates
        if not with_room:
            return None
        if self.policy is not None:
            return self.policy.pick(self.role, with_room, list(hashes))
        best = _longest_cached_prefix(with_room, hashes, self._bound(with_room))
        if best is not None:
            return best

        def score(w: Worker) -> tuple[float, int, str]:
            kv_used = 1.0 - w.kv_blocks_free / w.kv_blocks_total if w.kv_blocks_total else 0.0
            return (2.0 * w.num_waiting + w.num_running + w.inflight + 4.0 * kv_used, w.inflight, w.address)

        return min(with_room, key=score)


def _longest_cached_prefix(candidates: list[Worker], hashes: list[int], bound: int) -> Worker | None:
    """The worker under the load bound whose published cache holds the longest leading run of
    the prompt's blocks (at least one); None when no worker holds the first block."""
    best, best_overlap = None, 0
    for w in candidates:
        overlap = 0
        for h in hashes:
            if h not in w.cached_blocks:
                break
            overlap += 1
        if overlap > best_overlap and w.load < bound:
            best, best_overlap = w, overlap
    return best


# ----------------------------------------------------------------------------- discovery


def parse_targets(spec: str) -> tuple[list[str], str | None, int | None]:
    """`a:1,b:2` -> static list; `dns:///name:port` -> (`[]`, name, port)."""
    spec = spec.strip()
    if spec.startswith("dns:///"):
        host, _, port = spec[len("dns:///"):].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"expected dns:///NAME:PORT, got {spec!r}")
        return [], host, int(port)
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    for a in addresses:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"expected HOST:PORT, got {a!r}")
    return addresses, None, None


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_dns(name: str, port: int) -> list[str]:
    """Every address a (headless Service) name resolves to, as host:port."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    out = set()
    for family, _, _, _, sockaddr in infos:
        host = sockaddr[0]
        out.add(f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}")
    return sorted(out)


class Discovery:
    """Keeps a pool's members equal to a static list or to what a DNS name resolves to."""

    def __init__(self, pool: WorkerPool, spec: str, refresh_s: float = 5.0, resolver: Resolver = resolve_dns):
        self.pool = pool
        self.static, self.name, self.port = parse_targets(spec)
        self.refresh_s = refresh_s
        self.resolver = resolver
        self._task: asyncio.Task | None = None

    async def refresh(self) -> None:
        if self.name is None:
            self.pool.set_members(self.static)
            return
        try:
            self.pool.set_members(await self.resolver(self.name, self.port))
        except OSError as e:  # keep the last known members; the next refresh may succeed
            log.warning("cannot resolve %s: %s", self.name, e)

    async def start(self) -> None:
        await self.refresh()
        if self.name is not None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
