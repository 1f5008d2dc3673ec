"""Ranks on more than one node: the leader's engine and `kvrelay parallel-worker` on every other node.

SGLang's flags: `--nnodes N --node-rank I --dist-init-addr HOST:PORT`. Node I hosts ranks
[I*k, (I+1)*k) with k = world size / N; node 0 is the engine (the driver and its k local workers).
torch.distributed rendezvouses at HOST:PORT (rank 0's store, on the leader); the leader's control
listener is HOST:PORT+1. A follower node connects there twice over: its supervisor (`parallel-worker`)
once, to receive the WorkerSpec and to report a dead rank, and each of its ranks once, a connection
that replaces the local pipe (the same messages). Connections are multiprocessing's (HMAC challenge
with the shared token `KVRELAY_PARALLEL_TOKEN`, which every node must have: the messages are pickles).
A supervisor that dies closes its connection, and the leader fails the engine naming the node's
ranks, as for a local rank; a node that does not join within KVRELAY_PARALLEL_JOIN_TIMEOUT_S fails
the start with the command to run there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, wait

import torch.multiprocessing as mp
from kvrelay.engine.cpu_threads import usable_cpus
from kvrelay.engine.parallel.worker import WorkerSpec, decode, encode, worker_main

log = logging.getLogger(__name__)

TOKEN_ENV = "KVRELAY_PARALLEL_TOKEN"
JOIN_TIMEOUT_ENV = "KVRELAY_PARALLEL_JOIN_TIMEOUT_S"


class MultinodeError(ValueError):
    """A node could not join, or the multi-node flags are inconsistent."""


@dataclass(frozen=True)
class NodeLayout:
    nnodes: int
    node_rank: int
    host: str
    port: int  # torch.distributed's rendezvous; the leader's control listener is port + 1
    world_size: int

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node: int) -> range:
        k = self.ranks_per_node
        return range(node * k, (node + 1) * k)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def control_address(self) -> tuple[str, int]:
        return self.host, self.port + 1

    def follower_command(self, node: int) -> str:
        return (f"kvrelay parallel-worker --nnodes {self.nnodes} --node-rank {node} "
                f"--dist-init-addr {self.host}:{self.port}")


def parse_layout(nnodes: int, node_rank: int, dist_init_addr: str | None, world_size: int) -> NodeLayout:
    """One clear error for each inconsistent flag."""
    if nnodes < 1:
        raise MultinodeError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise MultinodeError(f"--node-rank must be in [0, {nnodes}), got {node_rank}")
    if not dist_init_addr or ":" not in dist_init_addr:
        raise MultinodeError(f"--nnodes {nnodes} needs --dist-init-addr HOST:PORT (the leader's address)")
    host, _, port = dist_init_addr.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65535:
        raise MultinodeError(f"--dist-init-addr: bad port in {dist_init_addr!r}")
    if world_size % nnodes:
        raise MultinodeError(f"--tensor-parallel-size x --pipeline-parallel-size = {world_size} ranks cannot be "
                             f"split evenly over --nnodes {nnodes}")
    return NodeLayout(nnodes, node_rank, host.strip("[]"), int(port), world_size)


def token_from_env() -> bytes:
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise MultinodeError(f"--nnodes > 1: set {TOKEN_ENV} to the same secret on every node (it authenticates "
                             f"the control connections, which carry pickles)")
    return token.encode()


def join_timeout() -> float:
    return float(os.environ.get(JOIN_TIMEOUT_ENV, "600"))


class Leader:
    """The leader's side: accepts the follower nodes' supervisors and ranks."""

    def __init__(self, layout: NodeLayout, token: bytes):
        self.layout = layout
        # Every interface: followers reach the leader by the address in --dist-init-addr.
        try:
            self.listener = Listener(("0.0.0.0", layout.port + 1), authkey=token)
        except OSError as e:
            raise MultinodeError(f"cannot listen for the other nodes on port {layout.port + 1} (--dist-init-addr "
                                 f"port + 1): {e}") from e
        self.node_conns: dict[int, Connection] = {}  # follower node -> its supervisor's connection
        self.rank_conns: dict[int, Connection] = {}  # remote rank -> its connection (the pipe's stand-in)
        # close() runs from the engine's thread and from the executor's watcher when a rank dies.
        self._close_lock = threading.Lock()
        self._closed = False

    def accept(self, spec: WorkerSpec, timeout: float) -> None:
        """Waits until every follower node's supervisor and ranks have connected; sends each supervisor
        the spec. Raises MultinodeError naming the nodes missing at the deadline."""
        expected_nodes = set(range(1, self.layout.nnodes))
        expected_ranks = {r for n in expected_nodes for r in self.layout.node_ranks(n)}
        errors: list[str] = []

        def loop() -> None:
            while set(self.node_conns) != expected_nodes or set(self.rank_conns) != expected_ranks:
                try:
                    conn = self.listener.accept()
                except AuthenticationError:
                    log.warning("a parallel-worker connection was refused: wrong %s", TOKEN_ENV)
                    continue
                except OSError:  # the listener was closed at the deadline
                    return
                try:
                    kind, who, nnodes = decode(conn.recv_bytes()) if conn.poll(30) else (None, None, None)
                except (EOFError, OSError):
                    continue
                if kind == "node" and who in expected_nodes and nnodes == self.layout.nnodes:
                    conn.send_bytes(encode(("spec", who, (spec, list(self.layout.node_ranks(who))))))
                    self.node_conns[who] = conn
                elif kind == "rank" and who in expected_ranks:
                    self.rank_conns[who] = conn
                else:
                    msg = (f"a parallel-worker sent {kind} {who} (--nnodes {nnodes}); the leader expects nodes "
                           f"1..{self.layout.nnodes - 1} of --nnodes {self.layout.nnodes}")
                    errors.append(msg)
                    log.error("%s", msg)
                    conn.send_bytes(encode(("error", 0, msg)))
                    conn.close()

        thread = threading.Thread(target=loop, name="kvrelay-node-accept", daemon=True)
        thread.start()
        thread.join(timeout)
        self.listener.close()  # no later joiners: the world is complete or the start fails
        thread.join(5.0)
        missing = sorted(expected_nodes - set(self.node_conns)) or sorted(
            {self.layout.node_of(r) for r in expected_ranks - set(self.rank_conns)})
        if missing:
            hint = "; ".join(f"node {n}: `{self.layout.follower_command(n)}`" for n in missing)
            raise MultinodeError(f"parallel nodes {missing} did not join the leader at "
                                 f"{self.layout.host}:{self.layout.port + 1} within {timeout:.0f}s "
                                 f"({JOIN_TIMEOUT_ENV}); start on each, with the same {TOKEN_ENV}: {hint}"
                                 + (f" ({errors[-1]})" if errors else ""))

    def node_death(self, node: int) -> tuple[str, int]:
        """Why a follower node's supervisor connection became readable: (what happened, the rank)."""
        conn = self.node_conns[node]
        ranks = self.layout.node_ranks(node)
        try:
            if conn.poll(5.0):  # a rank's connection closed: its supervisor says why at once
                kind, rank, code = decode(conn.recv_bytes())
                if kind == "died":
                    return f"died with exit code {code} on node {node}", rank
        except (EOFError, OSError):
            pass
        return f"lost: node {node}'s parallel-worker (ranks {ranks.start}..{ranks.stop - 1}) disconnected", ranks.start

    def close(self) -> None:
        """Closes the listener and every connection, once (safe from two threads at a time)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self.listener.close()
            for conn in (*self.node_conns.values(), *self.rank_conns.values()):
                conn.close()


def _connect(address: tuple[str, int], token: bytes, deadline: float) -> Connection:
    """Client(address), retried until deadline while the leader is not listening yet."""
    waiting = False
    while True:
        try:
            return Client(address, authkey=token)
        except AuthenticationError as e:
            raise MultinodeError(f"the parallel leader at {address[0]}:{address[1]} refused this node: "
                                 f"{TOKEN_ENV} differs from the leader's") from e
        except OSError as e:
            if time.monotonic() >= deadline:
                raise MultinodeError(f"cannot join the parallel leader at {address[0]}:{address[1]}: {e}") from e
            if not waiting:
                log.info("waiting for the parallel leader at %s:%d (%s)", *address, e)
                waiting = True
            time.sleep(0.5)


def _remote_rank_main(rank: int, spec: WorkerSpec, address: tuple[str, int], token: bytes) -> None:
    """A follower node's rank: its connection to the leader's driver replaces the local pipe."""
    conn = Client(address, authkey=token)
    conn.send_bytes(encode(("rank", rank, None)))
    worker_main(rank, spec, conn, True)


def run_follower(layout: NodeLayout, token: bytes, timeout: float | None = None) -> int:
    """`kvrelay parallel-worker`: join the leader, start this node's ranks, and supervise them.
    Returns 0 when the leader closed the engine, 1 when a rank died or the leader was lost."""
    timeout = join_timeout() if timeout is None else timeout
    address = layout.control_address
    conn = _connect(address, token, time.monotonic() + timeout)
    conn.send_bytes(encode(("node", layout.node_rank, layout.nnodes)))
    if not conn.poll(timeout):
        raise MultinodeError(f"the parallel leader at {address[0]}:{address[1]} sent no spec within {timeout:.0f}s")
    kind, _, payload = decode(conn.recv_bytes())
    if kind == "error":
        raise MultinodeError(payload)
    spec, ranks = payload
    cores = usable_cpus()  # affinity and cgroup quota
    spec = dataclasses.replace(spec, threads=max(1, cores // len(ranks)))
    log.info("node %d: starting parallel ranks %s (leader %s:%d)", layout.node_rank, ranks, *address)
    ctx = mp.get_context("spawn")
    procs = {}
    for rank in ranks:
        proc = ctx.Process(target=_remote_rank_main, args=(rank, spec, address, token), daemon=True,
                           name=f"kvrelay-worker-rank{rank}")
        proc.start()
        procs[proc.sentinel] = (rank, proc)
    try:
        while procs:
            ready = wait([conn, *procs])
            if conn in ready:  # the leader closed (or died): the ranks see their own connections close
                _join_or_kill([p for _, p in procs.values()], 10.0)
                return 0 if all(p.exitcode == 0 for _, p in procs.values()) else 1
            for sentinel in ready:
                rank, proc = procs.pop(sentinel)
                proc.join()
                if proc.exitcode != 0:
                    log.error("parallel worker rank %d died with exit code %s", rank, proc.exitcode)
                    try:
                        conn.send_bytes(encode(("died", rank, proc.exitcode)))
                    except OSError:
                        pass
                    _join_or_kill([p for _, p in procs.values()], 0.0)
                    return 1
        return 0
    finally:
        conn.close()


def _join_or_kill(procs: list, grace: float) -> None:
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5.0)
