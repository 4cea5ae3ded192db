"""What ``elaswave-run`` was asked to run on a node (:class:`LaunchConfig`), and the errors of a
launch that cannot run."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_elaswave.launch.etcd_address import EtcdAddress, StoreURLError
from megatron_elaswave.launch.proctitle import MEGATRON_LM_RUNNER
from megatron_elaswave.launch.spawn import DEFAULT_PRELOAD

STORE_ADDR_ENV = "ELASWAVE_STORE_ADDR"
"""The host of the job's ``TCPStore``, or the etcd URL of its namespace (``etcd://...``)."""
STORE_PORT_ENV = "ELASWAVE_STORE_PORT"
REJOIN_ENV = "ELASWAVE_REJOIN"
"""Set to ``1`` in a worker that replaces a dead one in a running job: it joins the job at a step
boundary instead of forming generation 0 with the others."""

DEFAULT_SHUTDOWN_GRACE_S = 10.0
"""How long workers may take to exit after a forwarded signal, unless told (``--shutdown-grace``)."""


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value of ``flag`` in a worker's ``args`` (``--flag V`` or ``--flag=V``), if given."""
    for at, arg in enumerate(args):
        if arg == flag and at + 1 < len(args):
            return args[at + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


class LaunchError(Exception):
    """The job cannot run; the message is one line meant for the user."""

    exit_status = 1


class UsageError(LaunchError):
    """The command line asks for something impossible, or the job store's port is taken."""

    exit_status = 2


def is_megatron_lm_script(path: str) -> bool:
    """Whether ``path`` is a script at the root of a Megatron-LM checkout (beside its
    ``megatron/training`` package), like Megatron-LM's ``pretrain_gpt.py``."""
    root = os.path.dirname(os.path.abspath(path))
    return os.path.isfile(os.path.join(root, "megatron", "training", "__init__.py"))


@dataclass(frozen=True)
class LaunchConfig:
    """What ``elaswave-run`` was asked to run on this node."""

    script: str
    """Path of the training script, or a module name when ``run_as_module``."""
    script_args: tuple[str, ...] = ()
    """Arguments passed to the script, unchanged."""
    run_as_module: bool = False
    """Run ``python -m script`` instead of ``python script``."""
    nproc_per_node: int = 1
    """Workers per node; the same on every node."""
    nnodes: int = 1
    """Number of node agents that form the job."""
    node_rank: int | None = 0
    """This agent's node rank; node rank 0 hosts the job store. ``None``: the agent takes one
    as it reaches the job store (:func:`~megatron_elaswave.launch.launcher.run`; ``--rdzv-backend c10d`` without a node rank)."""
    master_addr: str = "127.0.0.1"
    """Address of node rank 0, where the job store listens."""
    master_port: int = 29500
    """Port of the job store (of node 0's ``TCPStore``; with :attr:`store`, it is only handed to
    the workers as ``MASTER_PORT``)."""
    store: str | None = None
    """``etcd://HOST:PORT[,HOST:PORT...]``: keep the job store on that etcd cluster, under the
    namespace ``elaswave/<run id>/``; ``None``: node rank 0's agent hosts a ``TCPStore``."""
    store_compaction_interval_s: float = 60.0
    """With :attr:`store`: how often the lowest running node's agent compacts the etcd
    cluster's history (:class:`~megatron_elaswave.launch.etcd_store.HistoryCompaction`); 0
    leaves it to the cluster."""
    run_id: str = "none"
    """Job id; agents with different ids refuse to form a job together."""
    log_dir: str | None = None
    """Directory for ``rank<r>.log`` (stdout and stderr of each worker); ``None`` to inherit."""
    shutdown_grace_s: float | None = None
    """After a forwarded signal, how long workers may take to exit before SIGKILL; ``None``: not
    given (:meth:`grace_after`)."""
    join_timeout_s: float = 300.0
    """How long to wait for the store and for all node agents to join."""
    node_timeout_s: float = 10.0
    """Heartbeat silence after which node rank 0 declares another node lost."""
    rejoin: bool = False
    """Start a dead worker again in its slot, and let this agent take the place of a lost node
    with the same node rank (module docstring)."""
    rejoin_delay_s: float = 5.0
    """With ``rejoin``: seconds between a worker's death and its replacement's start."""
    max_rejoins: int = 3
    """With ``rejoin``: how many times one slot is started again."""
    exclusion_grace_s: float = 10.0
    """How long a worker that the job excluded (stopped or hung, not dead) has to leave by
    itself before the agent kills it."""
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    """Modules a fork server imports once, while the job forms, to fork every worker from
    (:mod:`megatron_elaswave.launch.spawn`); empty to execute each worker afresh."""
    role: str = "default"
    """The workers' ``ROLE_NAME`` (torchrun's ``--role``)."""

    def grace_after(self, signum: int | None) -> float:
        """How long the workers may take to exit after ``signum`` is forwarded (``None``: after
        the job store is lost): ``--shutdown-grace``; else, for SIGTERM to workers that save a
        checkpoint on it (``--exit-signal-handler``), the bound they put on finishing that save
        (their ``--distributed-timeout-minutes``, Megatron's default 10); else 10 s."""
        if self.shutdown_grace_s is not None:
            return self.shutdown_grace_s
        if signum == signal.SIGTERM and "--exit-signal-handler" in self.script_args:
            minutes = _flag_value(self.script_args, "--distributed-timeout-minutes")
            return 60 * float(minutes if minutes is not None else 10)
        return DEFAULT_SHUTDOWN_GRACE_S

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1, got {self.nnodes}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}"
            )
        if not 0 < self.master_port < 2**16:
            raise UsageError(f"--master-port must be in 1..65535, got {self.master_port}")
        if ((self.shutdown_grace_s or 0) < 0 or self.join_timeout_s <= 0
                or self.node_timeout_s <= 0):
            raise UsageError("timeouts must be positive (and --shutdown-grace not negative)")
        if self.store_compaction_interval_s < 0:
            raise UsageError("--store-compaction-interval must not be negative")
        if self.rejoin_delay_s < 0 or self.max_rejoins < 0 or self.exclusion_grace_s < 0:
            raise UsageError("--rejoin-delay, --max-rejoins and --exclusion-grace must not be "
                             "negative")
        if not self.run_as_module and not os.path.isfile(self.script):
            raise UsageError(f"no such script: {self.script}")
        if self.store is not None:
            try:
                self.etcd_address
            except StoreURLError as error:
                raise UsageError(f"--store {error}") from None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def is_store_host(self) -> bool:
        """Whether this agent hosts the job store (node 0, without :attr:`store`)."""
        return self.node_rank == 0 and self.store is None

    @property
    def etcd_address(self) -> EtcdAddress | None:
        """The job's namespace on the etcd cluster of :attr:`store`, if any."""
        return None if self.store is None else EtcdAddress.parse(self.store, self.run_id)

    @property
    def store_host(self) -> str:
        """The host of the job store: node 0's (``--master-addr``), or the first etcd member's."""
        return self.master_addr if self.store is None else self.etcd_address.endpoints[0][0]

    def global_rank(self, local_rank: int, node_rank: int | None = None) -> int:
        node = self.node_rank if node_rank is None else node_rank
        return node * self.nproc_per_node + local_rank

    def worker_command(self) -> list[str]:
        """The command line of every worker (unbuffered, so logs keep up with a failure)."""
        return [sys.executable, "-u", *self.worker_argv()]

    def worker_argv(self) -> list[str]:
        """What follows the interpreter and its flags in :meth:`worker_command`. A script of a
        Megatron-LM checkout runs through the adaptor's runner."""
        if self.run_as_module:
            entry = ["-m", self.script]
        elif is_megatron_lm_script(self.script):
            entry = ["-m", MEGATRON_LM_RUNNER, self.script]
        else:
            entry = [self.script]
        return [*entry, *self.script_args]

    @property
    def runs_megatron_lm(self) -> bool:
        """Whether the workers run Megatron-LM's loop (through the adaptor's runner)."""
        return self.worker_argv()[:2] == ["-m", MEGATRON_LM_RUNNER]

    @staticmethod
    def shared_worker_env(base: Mapping[str, str]) -> dict[str, str]:
        """The part of :meth:`worker_env` that is the same for every worker of the node."""
        env = dict(base)
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def worker_env(self, local_rank: int, base: Mapping[str, str], *,
                   restart_count: int = 0, rejoining: bool = False) -> dict[str, str]:
        """``base`` plus what torchrun sets, plus where the job store is and, for a replacement
        worker, :data:`~REJOIN_ENV`.

        ``TORCHELASTIC_USE_AGENT_STORE=True`` makes ``init_process_group(init_method="env://")``
        connect to the agent's store as a client instead of hosting a store in rank 0. With the
        store on etcd there is no agent's store to connect to: it is ``False``, and the
        runtime forms its groups on the etcd store itself.
        """
        env = self.shared_worker_env(base)
        rank, world_size = self.global_rank(local_rank), str(self.world_size)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=world_size,
            LOCAL_WORLD_SIZE=str(self.nproc_per_node),
            GROUP_RANK=str(self.node_rank),
            GROUP_WORLD_SIZE=str(self.nnodes),
            NODE_RANK=str(self.node_rank),
            ROLE_NAME=self.role,
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=world_size,
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
            TORCHELASTIC_RUN_ID=self.run_id,
            TORCHELASTIC_USE_AGENT_STORE=str(self.store is None),
            TORCHELASTIC_RESTART_COUNT=str(restart_count),
            TORCHELASTIC_MAX_RESTARTS=str(self.max_rejoins if self.rejoin else 0),
        )
        if self.store is None:
            env[STORE_ADDR_ENV] = self.master_addr
            env[STORE_PORT_ENV] = str(self.master_port)
        else:
            env[STORE_ADDR_ENV] = self.etcd_address.url
            env.pop(STORE_PORT_ENV, None)
        if rejoining:
            env[REJOIN_ENV] = "1"
        else:
            env.pop(REJOIN_ENV, None)
        return env
