"""Worker choice for the disaggregated mode: affinity, bounded load, liveness, discovery."""

from __future__ import annotations

import random

import pytest
from kvrelay.gateway.routing import Discovery, WorkerPool, block_hashes, parse_targets


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def pool_with(n: int, role: str = "prefill", clock=None) -> WorkerPool:
    pool = WorkerPool(role, clock=clock or Clock())
    pool.set_members([f"10.0.0.{i}:50051" for i in range(n)])
    for address in pool.workers:
        pool.report(address, num_waiting=0, num_running=0, kv_blocks_free=100, kv_blocks_total=100)
    return pool


def test_block_hashes_chain_and_ignore_partial_blocks():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2
    assert block_hashes(list(range(32)) + [999] * 8, 16) == a  # only full blocks count
    assert block_hashes([7] + list(range(1, 40)), 16)[1] != a[1]  # a change earlier changes later hashes


def test_same_prefix_sticks_to_one_worker_and_prefixes_spread():
    pool = pool_with(4)
    rng = random.Random(0)
    prefix = [rng.randrange(512) for _ in range(64)]
    chosen = {pool.pick_prefill(block_hashes(prefix + [rng.randrange(512) for _ in range(20)], 16)).address
              for _ in range(20)}
    assert len(chosen) == 1
    spread = {pool.pick_prefill(block_hashes([rng.randrange(512) for _ in range(64)], 16)).address
              for _ in range(200)}
    assert len(spread) == 4


def test_bounded_load_moves_a_hot_prefix_off_an_overloaded_worker():
    pool = pool_with(3)
    hashes = block_hashes(list(range(64)), 16)
    home = pool.pick_prefill(hashes)
    home.inflight = 10  # far above 1.25 x the average
    other = pool.pick_prefill(hashes)
    assert other.address != home.address
    home.inflight = 0
    assert pool.pick_prefill(hashes).address == home.address


def test_published_cached_blocks_win_over_the_ring():
    pool = pool_with(3)
    hashes = block_hashes(list(range(64)), 16)
    ring_choice = pool.pick_prefill(hashes)
    holder = next(w for w in pool.workers.values() if w.address != ring_choice.address)
    pool.report(holder.address, num_waiting=0, num_running=0, kv_blocks_free=50, kv_blocks_total=100,
                cached_blocks=hashes[:3])
    assert pool.pick_prefill(hashes).address == holder.address


def test_a_decode_worker_offering_shared_memory_gets_a_prefill_worker_on_its_node():
    pool = pool_with(4)
    hashes = block_hashes(list(range(64)), 16)
    ring_choice = pool.pick_prefill(hashes)
    local, *others = [w for w in pool.workers.values() if w.address != ring_choice.address]
    for w in pool.workers.values():
        pool.report(w.address, num_waiting=0, num_running=0, kv_blocks_free=100, kv_blocks_total=100,
                    node="node-b" if w is local else "node-a")
    assert pool.pick_prefill(hashes, node="node-b").address == local.address
    assert pool.pick_prefill(hashes).address == ring_choice.address  # no shared memory: the ring as before
    assert pool.pick_prefill(hashes, node="node-c").address == ring_choice.address  # nobody there
    assert pool.pick_prefill(hashes, exclude=[local.address], node="node-b").address == ring_choice.address
    local.inflight = 10  # over the load bound: not worth the saved copy
    assert pool.pick_prefill(hashes, node="node-b").address != local.address
    local.inflight = 0
    # A published prefix cache still wins: a prefill it skips saves more than the network does.
    holder = others[0]
    pool.report(holder.address, num_waiting=0, num_running=0, kv_blocks_free=50, kv_blocks_total=100,
                cached_blocks=hashes[:2], node="node-a")
    assert pool.pick_prefill(hashes, node="node-b").address == holder.address


def test_decode_by_load_and_free_kv():
    pool = pool_with(3, "decode")
    a, b, c = pool.workers
    pool.report(a, num_waiting=3, num_running=8, kv_blocks_free=50, kv_blocks_total=100)
    pool.report(b, num_waiting=0, num_running=2, kv_blocks_free=0, kv_blocks_total=100)  # full
    pool.report(c, num_waiting=0, num_running=5, kv_blocks_free=60, kv_blocks_total=100)
    assert pool.pick_decode().address == c
    assert pool.pick_decode(exclude=[c]).address == a  # retry elsewhere


def test_decode_goes_back_to_the_worker_holding_the_conversation_while_under_the_bound():
    pool = pool_with(3, "decode")
    a, b, c = pool.workers
    turn2 = block_hashes(list(range(100, 300)), 16)  # 12 blocks: turn 1, its answer, a new message
    pool.report(a, num_waiting=0, num_running=2, kv_blocks_free=50, kv_blocks_total=100)
    pool.report(b, num_waiting=0, num_running=3, kv_blocks_free=50, kv_blocks_total=100, cached_blocks=turn2[:9])
    pool.report(c, num_waiting=0, num_running=3, kv_blocks_free=50, kv_blocks_total=100, cached_blocks=turn2[:4])
    assert pool.pick_decode().address == a  # no prompt: least loaded
    assert pool.pick_decode(turn2).address == b  # the longest cached run, though busier than a
    assert pool.pick_decode(turn2, exclude=[b]).address == c
    pool.workers[b].inflight = 6  # over 1.25 x the average load: the next longest run wins
    assert pool.pick_decode(turn2).address == c
    pool.workers[c].inflight = 6  # no holder under the bound: by load
    assert pool.pick_decode(turn2).address == a


def test_silent_worker_is_ejected_within_a_second_and_returns():
    clock = Clock()
    pool = pool_with(2, "decode", clock)
    a, b = pool.workers
    clock.now += 0.6
    pool.report(a, num_waiting=0, num_running=0, kv_blocks_free=1, kv_blocks_total=1)
    clock.now += 0.6  # b's last report is now 1.2 s old
    assert [w.address for w in pool.live()] == [a]
    pool.report(b, num_waiting=0, num_running=0, kv_blocks_free=1, kv_blocks_total=1)
    assert {w.address for w in pool.live()} == {a, b}
    assert pool_with(0).pick_prefill([1]) is None


async def test_discovery_static_and_dns():
    pool = WorkerPool("prefill")
    await Discovery(pool, "a:1,b:2").refresh()
    assert set(pool.workers) == {"a:1", "b:2"}
    # real DNS: localhost resolves through the system resolver
    dns = Discovery(pool, "dns:///localhost:7000")
    await dns.refresh()
    assert "127.0.0.1:7000" in pool.workers and "a:1" not in pool.workers
    # membership follows the name: a worker that vanishes from DNS leaves the pool
    answers = [["10.1.0.1:7000", "10.1.0.2:7000"], ["10.1.0.2:7000", "10.1.0.3:7000"]]

    async def resolver(name, port):
        return answers.pop(0)

    changing = Discovery(pool, "dns:///prefill.ns.svc:7000", resolver=resolver)
    await changing.refresh()
    assert set(pool.workers) == {"10.1.0.1:7000", "10.1.0.2:7000"}
    await changing.refresh()
    assert set(pool.workers) == {"10.1.0.2:7000", "10.1.0.3:7000"}


def test_parse_targets_errors_are_specific():
    assert parse_targets("dns:///svc:5") == ([], "svc", 5)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_targets("nohost")
    with pytest.raises(ValueError, match="dns:///NAME:PORT"):
        parse_targets("dns:///svc")
