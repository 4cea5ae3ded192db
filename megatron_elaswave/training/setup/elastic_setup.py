"""Building an :class:`~megatron_elaswave.training.recovery.elastic.ElasticTrainer`: for a rank launched with the job, or for a
replacement that joins a running one."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist

from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.launch.decisions import Decision
from megatron_elaswave.launch.keys import SNAPSHOT_COPIES_KEY
from megatron_elaswave.launch.store import connect_store, generation_store_address
from megatron_elaswave.metrics import MetricsWriter
from megatron_elaswave.patches import distributed_work
from megatron_elaswave.planner.frequency import PowerModel
from megatron_elaswave.planner.replan import nominal_clock_plan
from megatron_elaswave.runtime.communicator import GroupRegistry, Role
from megatron_elaswave.runtime.dvfs import DvfsGovernor, clock_backend
from megatron_elaswave.runtime.generation_store import GenerationStores
from megatron_elaswave.runtime.faults import FaultInjector
from megatron_elaswave.runtime.monitor import FailureMonitor, MonitorConfig

from ..recovery import relayout
from ..step.data import MicrobatchSource
from ..checkpointing.durable import DurableCheckpoints, DurableConfig, check_save_directory_is_shared
from ..recovery.elastic import ElasticTrainer
from ..step.layer_groups import ModelFactory, build_stage_objects
from ..step.loop import log
from ..step.migration import NamedShard
from ..step.model import seed_random_generators
from ..recovery.planning import cost_model, failure_free_layout
from ..recovery.protocol import Recovery
from ..step.snapshots import StepSnapshots, affordable_copies, ranks_per_node, snapshot_config
from ..step.stopping import StopConditions
from ..recovery.stragglers import RebalanceConfig, StragglerDetector


def build_elastic_trainer(args: argparse.Namespace, backend: DeviceBackend, rank: int,
                          world_size: int, vocab_size: int, train_source: MicrobatchSource,
                          valid_source: MicrobatchSource | None, *,
                          model_factory: ModelFactory | None = None,
                          first_global_batch_size: int | None = None,
                          **trainer_fields) -> ElasticTrainer:
    """Groups from the registry, the stage objects of the failure-free layout, the monitor.
    ``model_factory`` builds the chunks (default: from the flags); the layout deals
    ``first_global_batch_size`` samples (default ``--global-batch-size``); ``trainer_fields``
    are passed on to :class:`ElasticTrainer`."""
    store = connect_store(timeout=timedelta(minutes=args.distributed_timeout_minutes))
    config = MonitorConfig(heartbeat_timeout_s=args.elastic_heartbeat_timeout)
    timeout = timedelta(seconds=config.collective_timeout_s)
    layout = failure_free_layout(args, first_global_batch_size)
    registry = GroupRegistry(layout, rank, store=store, backend=backend.dist_backend, timeout=timeout,
                             stores=_generation_stores(store, rank, timeout, backend))
    model_factory = model_factory or ModelFactory.from_flags(args, vocab_size)
    # Its stage may span several layer groups (virtual stages); the seeds need no DP group.
    model_factory.seed_generators(registry.process_group_collection(registry.layer_groups()[0]))
    objects = build_stage_objects(args, layout, registry, model_factory, backend.device())
    monitor = FailureMonitor(store, rank, Decision.initial(world_size), config, job_size=world_size)
    _abandon_waits_on_failure(monitor)
    if args.save:
        _check_save_is_shared(args.save, registry.host_group(Role.WORLD), rank, world_size)
    copies = _agree_on_copies(args, objects, layout.position(rank)[2],
                              registry.host_group(Role.WORLD))
    if rank == 0:
        store.set(SNAPSHOT_COPIES_KEY, str(copies))
    snapshots = StepSnapshots(layout, rank, snapshot_config(args, copies),
                              group=registry.host_group(Role.WORLD))
    parts = _runtime_parts(args, backend, rank, vocab_size, config, model_factory, store,
                           snapshots, monitor)
    parts["governor"].apply(nominal_clock_plan(parts["cost"], layout, 0, PowerModel()), layout)
    return ElasticTrainer(
        args=args, objects=objects, pg_collection=objects.schedule_groups, backend=backend,
        layout=layout, train_source=train_source, valid_source=valid_source,
        metrics=MetricsWriter(args.elastic_metrics_file if rank == 0 else None), rank=rank,
        snapshots=snapshots, registry=registry, monitor=monitor, store=store,
        recovery_of=Recovery, **parts, **trainer_fields)


def _agree_on_copies(args: argparse.Namespace, objects, tp_rank: int, group) -> int:
    """The copies of each snapshot: ``--elastic-snapshot-replicas``, else the most that fit in
    every node's host memory (:func:`~megatron_elaswave.training.step.snapshots.affordable_copies`), from the largest shard and
    the least memory of any rank. Collective over ``group``, the ranks that hold a stage."""
    if args.elastic_snapshot_replicas is not None:
        return args.elastic_snapshot_replicas
    shard_bytes = sum(tensor.nbytes for tensor in NamedShard(objects, tp_rank).tensors().values())
    on_node = ranks_per_node() or 1
    needs = torch.tensor([shard_bytes, -psutil.virtual_memory().available // on_node],
                         dtype=torch.float64)
    dist.all_reduce(needs, op=dist.ReduceOp.MAX, group=group)
    largest_shard, least_memory = int(needs[0]), int(-needs[1])
    return affordable_copies(largest_shard, least_memory * on_node, on_node)


def _check_save_is_shared(save: str, group, rank: int, world_size: int) -> None:
    """:func:`~megatron_elaswave.training.checkpointing.durable.check_save_directory_is_shared` over the nodes the launcher (or
    torchrun) placed the ranks on; skipped where the environment names no nodes."""
    on_node, node = ranks_per_node(), os.environ.get("GROUP_RANK")
    if on_node is None or node is None:
        return
    check_save_directory_is_shared(save, group, rank=rank, node=int(node),
                                   nodes=world_size // on_node,
                                   first_on_node=os.environ.get("LOCAL_RANK") == "0")


def _generation_stores(store, rank: int, timeout: timedelta,
                       backend: DeviceBackend) -> GenerationStores:
    """Where each generation's groups meet and its members exchange holdings: a store hosted
    by one of them when the job store is on etcd and the groups are gloo's, the job store
    otherwise (:mod:`~megatron_elaswave.runtime.generation_store`)."""
    hosted = backend.dist_backend == "gloo"
    return GenerationStores(store, rank, timeout=timeout,
                            host_address=generation_store_address() if hosted else None)


def _abandon_waits_on_failure(monitor: FailureMonitor) -> None:
    """A gloo operation still pending when the monitor detects a failure is given up
    (:mod:`megatron_elaswave.patches.distributed_work`): every job has gloo groups, for its
    host-memory state if not for its collectives. NCCL's waits are left as they are."""
    distributed_work.abandon_waits_when(monitor.failure_detected)


def _runtime_parts(args: argparse.Namespace, backend: DeviceBackend, rank: int, vocab_size: int,
                   config: MonitorConfig, model_factory: ModelFactory, store,
                   snapshots: StepSnapshots, monitor: FailureMonitor) -> dict:
    """The trainer's model factory, planner costs, clock governor, fault injection, straggler
    handling, durable checkpoints and reasons to stop early, from the flags."""
    injector = FaultInjector(args.elastic_inject_failure, rank,
                             hang_s=3 * config.heartbeat_timeout_s)
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    return dict(
        model_factory=model_factory,
        cost=cost_model(args, vocab_size, backend),
        governor=DvfsGovernor(clock_backend(args.elastic_dvfs, backend.device().index or 0,
                                            args.elastic_dvfs_command), rank),
        injector=injector,
        durable=DurableCheckpoints(
            DurableConfig(rank=rank, timeout_s=timeout.total_seconds(),
                          retries=args.elastic_save_retries), store,
            lambda: connect_store(timeout=timeout), snapshots.store,
            dead=lambda: monitor.recorded_deaths()[0],
            inject=injector.at),
        stop_conditions=StopConditions(on_signal=args.exit_signal_handler,
                                       duration_mins=args.exit_duration_in_mins),
        slowdowns=tuple(args.elastic_inject_slowdown),
        detector=(StragglerDetector(RebalanceConfig(
            window=args.elastic_rebalance_window, min_gain=args.elastic_rebalance_min_gain,
            slow_stage_factor=args.elastic_slow_stage_factor))
                  if args.elastic_rebalance_window else None),
    )


def join_elastic_job(args: argparse.Namespace, backend: DeviceBackend, rank: int,
                     world_size: int, vocab_size: int, train_source: MicrobatchSource,
                     valid_source: MicrobatchSource | None, *,
                     model_factory: ModelFactory | None = None,
                     **trainer_fields) -> ElasticTrainer:
    """A replacement's trainer: ask to join, wait until the job takes this rank in at a step
    boundary, form the grown generation's groups with the members and receive the state.
    ``model_factory`` and ``trainer_fields`` as for :func:`build_elastic_trainer`. Raises
    :class:`~megatron_elaswave.training.recovery.relayout.JobFinished` if the job ends first, and
    :class:`~megatron_elaswave.training.recovery.relayout.JoinInterrupted` if a failure interrupts the join once the job has taken
    this rank in."""
    store = connect_store(timeout=timedelta(minutes=args.distributed_timeout_minutes))
    config = MonitorConfig(heartbeat_timeout_s=args.elastic_heartbeat_timeout)
    log(f" rank {rank} asks to rejoin the running job")
    relayout.request_join(store, rank)
    plan = relayout.wait_for_acceptance(store, rank)
    monitor = FailureMonitor(store, rank, plan.decision, config, job_size=world_size,
                             skip_recorded_deaths=True)
    _abandon_waits_on_failure(monitor)
    monitor.start()  # the members watch this rank's heartbeat from the plan on
    try:
        timeout = timedelta(seconds=config.collective_timeout_s)
        registry = GroupRegistry.joining(plan.layout, rank, store=store,
                                         backend=backend.dist_backend, timeout=timeout,
                                         generation=plan.decision.generation,
                                         abort=monitor.failure_detected,
                                         stores=_generation_stores(store, rank, timeout, backend))
        if rank in plan.layout.active_ranks():  # its stage may span several layer groups
            seed_random_generators(
                args.seed, registry.process_group_collection(registry.layer_groups()[0]))
        snapshots = StepSnapshots(plan.state_layout, rank,
                                  snapshot_config(args, int(store.get(SNAPSHOT_COPIES_KEY))))
        trainer = ElasticTrainer(
            args=args, objects=None, pg_collection=None, backend=backend,
            layout=plan.state_layout, train_source=train_source, valid_source=valid_source,
            metrics=MetricsWriter(None), rank=rank, iteration=plan.iteration, snapshots=snapshots,
            registry=registry, monitor=monitor, store=store, recovery_of=Recovery,
            **_runtime_parts(args, backend, rank, vocab_size, config,
                             model_factory or ModelFactory.from_flags(args, vocab_size), store,
                             snapshots, monitor),
            **trainer_fields)
        trainer.complete_change(plan)
    except Exception as error:
        if (failure := monitor.failure) is None:
            raise
        monitor.stop()
        raise relayout.JoinInterrupted(
            f"a failure interrupted rank {rank}'s join ({failure.detail}); it leaves the "
            "job") from error
    return trainer
