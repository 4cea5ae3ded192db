"""Every key of the job store, named in one place.

The launchers own the keys under ``elaswave/``; workers only read them. The workers' runtime keys
live under ``rt/`` and, since a job outlives its process groups, most are namespaced by the
generation ``g`` they belong to, so that a later generation never reads a stale key. Ranks are
launch ranks. ``docs/runtime.md`` lists the same keys with the module that writes each.

Launchers (:mod:`megatron_elaswave.launch.launcher`, :mod:`megatron_elaswave.launch.store`):

=====================================  ==================================================================
``elaswave/workers/<rank>``            ``WorkerRecord`` (JSON), set when the worker is spawned
``elaswave/exits/<rank>``              ``WorkerExit`` (JSON), set when the worker exits with 0
``elaswave/deaths/count``              deaths recorded so far (a ``store.add`` counter)
``elaswave/deaths/<i>``                ``WorkerDeath`` (JSON), the i-th death of the job
``elaswave/nodes/<n>``                 ``NodeRecord`` (JSON) of the launcher of node ``n``
``elaswave/nodes/<n>/heartbeat``       heartbeat of the launcher of node ``n`` (``silence.Heartbeat``)
``elaswave/nodes/<n>/done``            set when node ``n``'s workers have all ended
``elaswave/nodes/<n>/lost``            node ``n`` was declared lost (by the launcher that watched it);
                                       its launcher kills its workers
``elaswave/nodes/changes``             bumped whenever a node is lost, done or replaced: the launchers
                                       re-read ``elaswave/nodes/state`` only when it moved
``elaswave/nodes/state``               the nodes lost and the nodes done (JSON), in one key
=====================================  ==================================================================

Failure detection and agreement (:mod:`~megatron_elaswave.runtime.monitor`,
:mod:`~megatron_elaswave.runtime.agreement`, :mod:`~megatron_elaswave.runtime.world`):

=====================================  ==================================================================
``rt/alerts``                          bumped after each write every monitor must notice
``rt/heartbeat/<rank>``                heartbeat of ``rank``: a counter (``silence.Heartbeat``)
``rt/gen<g>/silent/count``             heartbeat silences reported in ``g`` (``store.add``)
``rt/gen<g>/silent/<i>``               the i-th ``Silence`` (JSON): a member found silent by a
                                       neighbour that watched it
``rt/gen<g>/round``                    ``FailureNotice`` (JSON) of the first rank that announced a
                                       failure in ``g``; its presence starts the agreement
``rt/gen<g>/joined/<rank>``            ``rank`` entered the agreement that ends ``g``
``rt/gen<g>/decision``                 the ``Decision`` (JSON) that ends ``g``, written once with
                                       ``compare_set`` (a failure's or a grow's)
``rt/gen<g>/ready``                     survivors about to form the default group of ``g`` (a
                                       ``store.add`` counter)
``gen<g>/...``                         torch's own rendezvous keys of ``g``'s default group
``rt/collected``                       the generations below it have had their keys deleted
=====================================  ==================================================================

Once generation ``g + 2`` starts, every key under :func:`generation_prefixes` ``(g)`` but
``rt/gen<g>/decision`` is deleted (:func:`megatron_elaswave.launch.store.collect_generations`): the
decisions stay, one small key per generation, for a rank or a launcher that reads them late.

Process groups (:mod:`~megatron_elaswave.runtime.communicator`); each barrier key is a ``store.add``
counter, and ``<barrier>/released`` is set by the last member to arrive:

=======================================  ================================================================
``rt/gen<g>/communicator/meet``          the survivors meet before a new default group
``rt/gen<g>/communicator/<group>``       the members of one group meet before creating it
``rt/gen<g>/communicator/created/<i>``   every survivor has created the ``i``-th group
=======================================  ================================================================

State restore after a recovery or a layout change (:mod:`~megatron_elaswave.training`):

=============================================  ==========================================================
``rt/gen<g>/restore/held/<rank>``              the snapshots ``rank`` holds (JSON ``[[rank, iteration,
                                               version, owners]]``, ``SnapshotTag``)
``rt/gen<g>/restore/state/tp<t>``              the small state for ranks that held no stage (plain
                                               data, :mod:`~megatron_elaswave.runtime.wire`)
``rt/gen<g>/restore/migrate/holds/<rank>``     the pieces ``rank`` can serve
``rt/gen<g>/restore/migrate/needs/<rank>``     the pieces ``rank`` needs
``rt/gen<g>/restore/rollback``                 the iteration to roll back to, or why there is none
                                               (JSON), published by the lowest member
``rt/gen<g>/restore/restored``                 members restored (a ``store.add`` counter, in the
                                               generation's store)
``rt/gen<g>/restore/outcome``                  ``committed`` (once every member restored) or ``abandoned``
``rt/gen<g>/done/<rank>``                      ``rank`` finished training in ``g``
``rt/finished``                                the job ends: every member finished (empty) or the
                                               survivors stopped (why)
``rt/records/written``                         the last iteration whose record the logger wrote
``rt/shared/<name>``                           a value a rank shares with the job, e.g. the id of the
                                               W&B run that a later logging rank resumes
``rt/snapshot_copies``                         the copies of each snapshot the job chose at start
=============================================  ==========================================================

Durable checkpoints (:mod:`~megatron_elaswave.training.checkpointing.durable`):

=============================================  ==========================================================
``rt/ckpt/<iteration>-g<g>/part/<rank>``       ``rank`` wrote its part of the save of ``iteration``
                                               (snapshots of layout ``g``); deleted once it commits
``rt/ckpt/<iteration>-g<g>/outcome``           ``committing``, ``committed`` or ``abandoned``, first
                                               written with ``compare_set``
``rt/ckpt/<iteration>-g<g>/error``             why the save could not be written (the first
                                               writer or finaliser that failed says)
``rt/ckpt/failed``                             the first save of the job that could not be written
``rt/ckpt/latest``                             the latest iteration whose save this job committed
``rt/ckpt/iter/<iteration>``                   set once this job committed the save of ``iteration``
``rt/ckpt/lock``                               the save that commits now (empty when none)
=============================================  ==========================================================

Start-up (:mod:`~megatron_elaswave.training.setup.startup`):

=====================================  ==================================================================
``rt/start/<rank>``                    ``rank`` holds its first snapshot (``--elastic``)
``rt/start``                           the verdict, written once: ``started``, or the line every
                                       worker stops with (a rank died before the job started)
=====================================  ==================================================================

Growth (:mod:`~megatron_elaswave.training.recovery.relayout`):

=====================================  ==================================================================
``rt/join/<rank>``                     a replacement for ``rank`` asks to join (JSON: pid, time)
``rt/join/<rank>/accepted``            the generation that takes ``rank`` in
``rt/gen<g>/change``                   the ``LayoutChange`` (JSON) that starts ``g`` at a step boundary
=====================================  ==================================================================
"""

from __future__ import annotations

# -- launchers ---------------------------------------------------------------------------------

DEATH_COUNT_KEY = "elaswave/deaths/count"


def worker_key(rank: int) -> str:
    return f"elaswave/workers/{rank}"


def exit_key(rank: int) -> str:
    return f"elaswave/exits/{rank}"


def death_key(index: int) -> str:
    return f"elaswave/deaths/{index}"


def node_key(node_rank: int) -> str:
    return f"elaswave/nodes/{node_rank}"


def node_heartbeat_key(node_rank: int) -> str:
    return f"elaswave/nodes/{node_rank}/heartbeat"


def node_done_key(node_rank: int) -> str:
    return f"elaswave/nodes/{node_rank}/done"


def node_lost_key(node_rank: int) -> str:
    return f"elaswave/nodes/{node_rank}/lost"


NODE_CHANGES_KEY = "elaswave/nodes/changes"
"""Bumped whenever a node is declared lost, ends or is replaced."""

NODES_STATE_KEY = "elaswave/nodes/state"
"""``{"lost": [...], "done": [...]}``: one read tells a launcher which nodes still run."""

NODE_ARRIVALS_KEY = "elaswave/nodes/arrivals"
"""Counts the agents that took a node rank as they reached the job store (``store.add``)."""


# -- failure detection and agreement -----------------------------------------------------------

ALERT_COUNT_KEY = "rt/alerts"
"""A counter bumped after each write the monitors must notice (a death record, a failure
announcement, a heartbeat silence); every monitor polls it (:mod:`megatron_elaswave.launch.alerts`)."""


def heartbeat_key(rank: int) -> str:
    return f"rt/heartbeat/{rank}"


def silence_count_key(generation: int) -> str:
    return f"rt/gen{generation}/silent/count"


def silence_key(generation: int, index: int) -> str:
    return f"rt/gen{generation}/silent/{index}"


def round_key(generation: int) -> str:
    return f"rt/gen{generation}/round"


def joined_key(generation: int, rank: int) -> str:
    return f"rt/gen{generation}/joined/{rank}"


def decision_key(generation: int) -> str:
    return f"rt/gen{generation}/decision"


def ready_key(generation: int) -> str:
    return f"rt/gen{generation}/ready"


def generation_store_key(generation: int) -> str:
    """``HOST:PORT`` of the store that a member of ``generation`` hosts for its bulk traffic."""
    return f"rt/gen{generation}/store"


def generation_prefix(generation: int) -> str:
    """The ``PrefixStore`` prefix of the default group's rendezvous in ``generation``."""
    return f"gen{generation}/"


def generation_prefixes(generation: int) -> tuple[str, ...]:
    """The prefixes of every key that belongs to ``generation`` alone: deleted once it is two
    generations past, all but its :func:`decision_key`."""
    return f"rt/gen{generation}/", generation_prefix(generation)


COLLECTED_KEY = "rt/collected"
"""The generations below this number have had their keys deleted."""


# -- process groups ----------------------------------------------------------------------------

def communicator_key(generation: int, barrier: str) -> str:
    return f"rt/gen{generation}/communicator/{barrier}"


# -- state restore -----------------------------------------------------------------------------

def restore_prefix(generation: int) -> str:
    """Prefix of the keys of the restore that starts ``generation``."""
    return f"rt/gen{generation}/restore"


def done_key(generation: int, rank: int) -> str:
    return f"rt/gen{generation}/done/{rank}"


def checkpoint_key(save: str, what: str) -> str:
    """Keys of the durable checkpoint ``save`` (``<iteration>-g<generation>``): ``part/<rank>``,
    ``outcome``, ``error``."""
    return f"rt/ckpt/{save}/{what}"


CHECKPOINT_LOCK_KEY = "rt/ckpt/lock"
"""The durable checkpoint that commits now; empty when none does."""

COMMITTING = "committing"
COMMITTED = "committed"
ABANDONED = "abandoned"
"""The values of an outcome key (a durable checkpoint's, a restore's), each first written with
``compare_set``: a change every rank sees resolved alike."""

CHECKPOINT_FAILED_KEY = "rt/ckpt/failed"
"""The first durable checkpoint of the job that could not be written (its save id)."""

CHECKPOINT_LATEST_KEY = "rt/ckpt/latest"
"""The latest iteration whose durable checkpoint this job committed."""


def committed_iteration_key(iteration: int) -> str:
    """Set once this job committed a durable checkpoint of ``iteration``."""
    return f"rt/ckpt/iter/{iteration}"

FINISHED_KEY = "rt/finished"
"""Set when the job ends: empty when every member finished, else why the survivors stopped."""

RECORDS_WRITTEN_KEY = "rt/records/written"
"""The last iteration whose record the logging rank has written to the metrics file."""


def shared_key(name: str) -> str:
    return f"rt/shared/{name}"


# -- start-up ----------------------------------------------------------------------------------

START_VERDICT_KEY = "rt/start"
"""``started``, or the line the workers stop with when a rank died before the job started."""


def started_key(rank: int) -> str:
    return f"rt/start/{rank}"


# -- growth ------------------------------------------------------------------------------------

def join_key(rank: int) -> str:
    return f"rt/join/{rank}"


def accepted_key(rank: int) -> str:
    return f"rt/join/{rank}/accepted"


SNAPSHOT_COPIES_KEY = "rt/snapshot_copies"
"""The number of copies of each snapshot the job chose at start, for replacements to use."""


def change_key(generation: int) -> str:
    return f"rt/gen{generation}/change"
