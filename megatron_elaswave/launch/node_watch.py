"""A node's heartbeat, and the watch its launcher keeps over the nodes that follow it
(:class:`NodeWatch`): their heartbeats, and a connection to each of their agents
(:mod:`~megatron_elaswave.launch.liveness`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Set
from typing import TYPE_CHECKING

from megatron_elaswave.launch.config import LaunchConfig
from megatron_elaswave.launch.console import log, rank_list
from megatron_elaswave.launch.guarded_store import GuardedStore
from megatron_elaswave.launch.keys import (
    NODE_CHANGES_KEY,
    node_done_key,
    node_heartbeat_key,
    node_key,
    node_lost_key,
)
from megatron_elaswave.launch.liveness import AgentConnection
from megatron_elaswave.launch.silence import Heartbeat, HeartbeatSilence, ring_neighbours
from megatron_elaswave.launch.store import (
    NODE_LOST,
    NodeRecord,
    WorkerDeath,
    change_node_state,
    from_json,
    read_deaths,
    read_exit,
    read_if_set,
    read_node_states,
    read_worker,
    record_death,
)

if TYPE_CHECKING:
    from torch.distributed import Store


WATCHED_NODES = 2
"""How many running nodes each agent watches the heartbeat of, and so how many watch each node."""


class NodeWatch:
    """This node's heartbeat, and the watch over the :data:`WATCHED_NODES` running nodes that
    follow it in node-rank order.

    Guarantees: a watched node is declared lost once, by the first of its watchers to find it,
    which then records the deaths of its workers that had not already ended; it is found when
    its agent's process has ended without the node being done (its connection closed and its
    port refuses connections, :class:`~megatron_elaswave.launch.liveness.AgentConnection`), or
    when its heartbeat is silent for ``--node-timeout`` seconds of this agent's attentive time
    (:class:`~megatron_elaswave.launch.silence.HeartbeatSilence`), whichever comes first.
    """

    def __init__(self, config: LaunchConfig, store: GuardedStore) -> None:
        self._config = config
        self._store = store
        self._heartbeat = Heartbeat(node_heartbeat_key(config.node_rank))
        self.interval_s = min(1.0, config.node_timeout_s / 4)
        """How often the agent beats and reads the heartbeats of the nodes it watches."""
        self._peers = HeartbeatSilence((), interval_s=self.interval_s,
                                       timeout_s=config.node_timeout_s, now=time.monotonic())
        """The nodes this agent watches, and how long each agent's heartbeat is silent."""
        self._running_nodes: set[int] = set(range(config.nnodes))
        self._lost_nodes: set[int] = set()
        """Nodes known to be declared lost: one that runs again was replaced."""
        self._node_changes_seen = -1
        """The count of node changes when :attr:`running_nodes` was read."""
        self._connections: dict[int, AgentConnection] = {}
        """A connection to the agent of each watched node that published a liveness port."""
        self._gone: set[int] = set()
        """Watched nodes whose agent's process ended, as their connections' threads found."""
        self._gone_lock = threading.Lock()

    @property
    def running_nodes(self) -> Set[int]:
        """The nodes neither lost nor done, as of the last change of the nodes."""
        return self._running_nodes

    def beat(self) -> None:
        """Beat this node's heartbeat, which the agents of the nodes before it watch."""
        self._store.call(self._heartbeat.beat)

    def heartbeat_finds_node_lost(self) -> int | None:
        """Beat this node's heartbeat; return the node rank of the agent that declared this node
        lost, if one did."""
        self.beat()
        lost = node_lost_key(self._config.node_rank)
        raw = self._store.call(lambda store: read_if_set(store, lost))
        return None if raw is None else json.loads(raw).get("by", 0)

    def watch(self, store: Store) -> None:
        """Follow the changes of the nodes, and declare lost a watched node that fell silent."""
        self._read_running_nodes(store)
        # add, not multi_get, which would wait for the counter of a node that never beat
        heartbeats = {n: store.add(node_heartbeat_key(n), 0) for n in self._peers.peers}
        for node_rank, silence_s in self._peers.read(heartbeats, time.monotonic()).items():
            self._forget(node_rank)
            self._declare_lost(store, node_rank, f"no heartbeat for {silence_s:.1f} s")

    @property
    def agents_gone(self) -> bool:
        """Whether the agent of a watched node has ended since :meth:`declare_agents_gone` was
        last called (read without the store, at every turn of the agent's loop)."""
        return bool(self._gone)

    def declare_agents_gone(self, store: Store) -> None:
        """Declare lost the watched nodes whose agent's process ended, unless they are done."""
        with self._gone_lock:
            gone, self._gone = self._gone, set()
        for node_rank in sorted(gone & set(self._peers.peers)):
            self._forget(node_rank)
            if not store.check([node_done_key(node_rank)]):
                self._declare_lost(store, node_rank, "its launcher's process ended (its "
                                   "connection closed and its port refuses connections)")

    def _agent_gone(self, node_rank: int) -> None:
        with self._gone_lock:
            self._gone.add(node_rank)

    def _watch_node(self, store: Store, node_rank: int) -> None:
        self._peers.add(node_rank)
        record = from_json(NodeRecord, store.get(node_key(node_rank)))
        if record.liveness:
            self._connections[node_rank] = AgentConnection(node_rank, record.liveness,
                                                           self._agent_gone)

    def _forget(self, node_rank: int) -> None:
        self._peers.forget(node_rank)
        if (connection := self._connections.pop(node_rank, None)) is not None:
            connection.close()

    def _read_running_nodes(self, store: Store) -> None:
        """Re-read which nodes run (neither lost nor done), when a node changed since the last
        read; watch the :data:`WATCHED_NODES` that follow this one from then on."""
        changes = store.add(NODE_CHANGES_KEY, 0)
        if changes == self._node_changes_seen:
            return
        self._node_changes_seen = changes
        states = read_node_states(store)
        lost, self._running_nodes = states.lost, states.running(self._config.nnodes)
        me = self._config.node_rank
        watched = set(ring_neighbours(sorted(self._running_nodes | {me}), me, WATCHED_NODES))
        for node_rank in set(self._peers.peers) - watched:
            self._forget(node_rank)
        for node_rank in sorted(watched - set(self._peers.peers)):
            self._watch_node(store, node_rank)
            if node_rank in self._lost_nodes:
                log(f"node {node_rank} rejoined the job")
        self._lost_nodes = (self._lost_nodes | lost) - self._running_nodes

    def _declare_lost(self, store: Store, node_rank: int, reason: str) -> None:
        """Fence the node first (if it comes back, its agent kills its workers), then record
        the deaths of its workers that have not already ended. Only the first agent to declare
        it does so: another watcher may have found it gone too."""
        now = time.time()
        mine = json.dumps({"time": now, "reason": reason, "by": self._config.node_rank})
        if store.compare_set(node_lost_key(node_rank), "", mine).decode() != mine:
            return
        change_node_state(store, node_rank, "lost")
        already_dead = {(death.rank, death.pid) for death in read_deaths(store)}
        recorded = []
        for local_rank in range(self._config.nproc_per_node):
            rank = self._config.global_rank(local_rank, node_rank)
            worker = read_worker(store, rank)
            pid = None if worker is None else worker.pid
            if (rank, pid) in already_dead or read_exit(store, rank) is not None:
                continue
            death = WorkerDeath(
                rank=rank,
                local_rank=local_rank,
                node_rank=node_rank,
                pid=pid,
                exit_code=None,
                signal=None,
                cause=NODE_LOST,
                time=now,
            )
            record_death(store, death)
            recorded.append(rank)
        deaths = f"recorded deaths for {rank_list(recorded)}" if recorded else "no worker left"
        log(f"node {node_rank} lost: {reason}; {deaths}")
