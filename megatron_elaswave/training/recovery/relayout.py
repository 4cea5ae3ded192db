"""Layout changes at a step boundary, without a failure: replacement ranks join (a grow), or
layers move off a slow stage (a rebalance, :mod:`.stragglers`).

Both run the same way: the lowest active rank commits the change, every member (and joiner)
follows it, the groups change, and the state of the iteration just finished is restored into the
new layout from the snapshots. What follows is the grow; a rebalance skips the requests and
acceptances and edits the groups in place.

A worker that ``elaswave-run --rejoin`` starts in a dead worker's slot (or that an agent replacing
a lost node starts) asks to join in the store and waits. The members see the request through
their failure monitors and add it to the next iteration's all-reduce, so every stage holder
learns of it after the same iteration. Then, at that step boundary:

1. the lowest active rank plans the grown layout (the failure-free one when every lost rank is
   back) and commits a :class:`~megatron_elaswave.launch.decisions.Decision` with ``joined`` set on the
   generation's decision key. The key takes one decision per generation: if a failure's
   agreement committed first, the grow is abandoned and the failure recovered as usual;
2. it publishes the :class:`LayoutChange` and accepts the joiners;
3. members and joiners form the next generation's default group and every group of the grown
   layout (a ``full`` edit: a new process cannot enter groups formed without it), restore the
   state of the iteration just finished from the members' snapshots (the joiners receive their
   parameters and optimizer shards from their peers), and continue with the next iteration.

The grow changes nothing in the training trajectory: the state is that of the step boundary, and
the global batch, micro-batch ids and layout-invariant RNG do not depend on the layout.

Its keys (``rt/join/<rank>``, ``rt/join/<rank>/accepted``, ``rt/gen<g>/change``,
``rt/finished``) are named in :mod:`megatron_elaswave.launch.keys`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from megatron_elaswave.launch.decisions import Decision
from megatron_elaswave.launch.keys import FINISHED_KEY, accepted_key, change_key, decision_key, join_key
from megatron_elaswave.launch.store import raise_alert, read_if_set
from megatron_elaswave.layout import Layout
from megatron_elaswave.planner.frequency import ClockPlan
from megatron_elaswave.waiting import wait_until

if TYPE_CHECKING:
    from torch.distributed import Store

_POLL_INTERVAL_S = 0.05
"""The longest pause between two looks for a plan or an acceptance: they wait on steps."""

RELAYOUT_DELAY_ENV = "ELASWAVE_RELAYOUT_DELAY_S"
"""Fault injection for tests: every member pauses this many seconds once a change is committed
(``rt/gen<g>/change`` is in the store), before it edits its groups, so that a test can fail a
rank while the layout changes."""


def pause_for_tests() -> None:
    """The pause :data:`RELAYOUT_DELAY_ENV` asks for (none by default)."""
    delay_s = float(os.environ.get(RELAYOUT_DELAY_ENV, "0"))
    if delay_s > 0:
        time.sleep(delay_s)


class JobFinished(Exception):
    """The job ended before this replacement could join."""


class JobStopped(JobFinished):
    """The job's survivors stopped (they could not continue) before this replacement could
    join: the replacement stops with them."""


class JoinInterrupted(RuntimeError):
    """A failure in the job interrupted this replacement's join after the job took it in: it
    holds no state to recover with, so it leaves (a death the survivors recover from), and its
    launcher may start it again (``--rejoin``)."""


@dataclass(frozen=True)
class LayoutChange:
    """What every rank of the changed generation needs to know."""

    decision: Decision
    """The generation's membership; ``decision.joined`` are the joining ranks (none for a
    rebalance)."""
    layout: Layout
    """The layout from the change on."""
    state_layout: Layout
    """The layout whose snapshots hold the state: the one before the change."""
    iteration: int
    """The iteration after which the layout changes."""
    clocks: ClockPlan
    """The clocks of ``layout`` (:mod:`megatron_elaswave.runtime.dvfs`)."""
    announced_at: float
    """Unix time of the commit, where the change's ``total_s`` starts."""
    reason: str = ""
    """Why a rebalance moves layers (empty for a grow)."""
    predicted_gain: float = 1.0
    """A rebalance's predicted step speed-up."""

    def to_json(self) -> str:
        return json.dumps({
            "decision": json.loads(self.decision.to_json()),
            "layout": _layout_json(self.layout),
            "state_layout": _layout_json(self.state_layout),
            "iteration": self.iteration,
            "clocks": {**vars(self.clocks), "clocks": [list(c) for c in self.clocks.clocks]},
            "announced_at": self.announced_at,
            "reason": self.reason,
            "predicted_gain": self.predicted_gain,
        })

    @classmethod
    def from_json(cls, raw: str | bytes) -> LayoutChange:
        fields = json.loads(raw)
        clocks = fields["clocks"]
        return cls(
            decision=Decision.from_json(json.dumps(fields["decision"])),
            layout=_layout_from_json(fields["layout"]),
            state_layout=_layout_from_json(fields["state_layout"]),
            iteration=fields["iteration"],
            clocks=ClockPlan(**{**clocks, "clocks": tuple(tuple(c) for c in clocks["clocks"])}),
            announced_at=fields["announced_at"],
            reason=fields["reason"],
            predicted_gain=fields["predicted_gain"],
        )


def _layout_json(layout: Layout) -> dict:
    return {"replicas": layout.to_json(with_microbatch_ids=True), "spares": list(layout.spares),
            "experts": layout.experts.to_json() if layout.experts else None}


def _layout_from_json(fields: dict) -> Layout:
    return Layout.from_json(fields["replicas"], fields["spares"], fields.get("experts"))


# -- the joining rank ----------------------------------------------------------------------------

def request_join(store: Store, rank: int) -> None:
    """Ask the job to take launch rank ``rank`` in (an acceptance left by an earlier incarnation
    of the rank is cleared first)."""
    store.delete_key(accepted_key(rank))
    store.set(join_key(rank), json.dumps({"pid": os.getpid(), "time": time.time()}))
    raise_alert(store)  # the monitors look for requests at alerts


def wait_for_acceptance(store: Store, rank: int) -> LayoutChange:
    """Block until the job accepts ``rank``; raises :class:`JobFinished` if it ends first
    (:class:`JobStopped` if its survivors stopped)."""
    accepted = accepted_key(rank)
    wait_until(lambda: store.check([accepted]) or store.check([FINISHED_KEY]), None,
               max_pause_s=_POLL_INTERVAL_S)
    if not store.check([accepted]):
        if stopped := store.get(FINISHED_KEY).decode():
            raise JobStopped(f"the job stopped ({stopped}) before rank {rank} could rejoin it")
        raise JobFinished(f"the job finished before rank {rank} could rejoin it")
    generation = int(store.get(accepted))
    return LayoutChange.from_json(store.get(change_key(generation)))


# -- the members ---------------------------------------------------------------------------------

def commit(store: Store, plan: LayoutChange) -> bool:
    """Commit ``plan``'s decision for the generation it ends, publish the plan and accept the
    joiners; ``False`` (nothing published) when another decision, a failure's, came first."""
    ended = plan.decision.generation - 1
    mine = plan.decision.to_json()
    if store.compare_set(decision_key(ended), "", mine).decode() != mine:
        return False
    store.set(change_key(plan.decision.generation), plan.to_json())
    for rank in plan.decision.joined:
        store.set(accepted_key(rank), str(plan.decision.generation))
        store.delete_key(join_key(rank))
    return True


def published_plan(store: Store, generation: int) -> LayoutChange | None:
    """The plan of ``generation`` if one was published."""
    raw = read_if_set(store, change_key(generation))
    return None if raw is None else LayoutChange.from_json(raw)


def committed_plan(store: Store, generation: int, timeout: timedelta) -> LayoutChange:
    """The plan of ``generation``, whose decision is known to be committed: its committer
    publishes the plan right after."""
    key = change_key(generation)
    store.wait([key], timeout)
    return LayoutChange.from_json(store.get(key))


def wait_for_plan(store: Store, generation: int, failure: threading.Event) -> LayoutChange | None:
    """The plan of ``generation``; ``None`` as soon as ``failure`` is set."""
    if not wait_until(lambda: store.check([change_key(generation)]), None, abandon=failure,
                      max_pause_s=_POLL_INTERVAL_S):
        return None
    return published_plan(store, generation)
