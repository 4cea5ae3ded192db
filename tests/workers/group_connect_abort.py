"""Two ranks re-create their groups in place, as survivors do in a recovery, while rank 1 hangs
(it SIGSTOPs itself) as soon as it has published its address for the group it shares with
rank 0; rank 0 reads that address only then. Gloo connects a pair from the side whose address
sorts first: when that is rank 0, its kernel-level connection to the hung rank 1 succeeds and
the group forms; when it is rank 1, rank 0 waits for a connection that never comes, until gloo
gives up after about five times the creation timeout. So the edit is repeated, one generation
after another, until rank 0 waits: the test resumes rank 1 (SIGCONT) after each edit that
formed the group.

Usage: group_connect_abort.py RANK STORE_PORT OUT_DIR. The test's store hosts the job. In
generation ``g``, rank 1 sets ``test/published/<g>`` and stops; the test sets
``test/stopped/<g>``; a thread of rank 0, standing in for the failure monitor, sets that edit's
abort event half a second later (while rank 0 connects). Rank 0 sets ``test/result/<g>`` to
``formed`` or ``ended``; after an edit that ended (or the last one) it writes
``OUT_DIR/rank0.json``: the generation, the error that ended the edit and the seconds from the
abort to it.
"""

import json
import os
import re
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from megatron_elaswave.layout import Layout
from megatron_elaswave.runtime.communicator import (
    EditMode,
    GroupRegistry,
    _group_name,
    group_specs,
    member_lists,
)
from megatron_elaswave.runtime.world import InterruptibleStore

DETECTION_DELAY_S = 0.5
GENERATIONS = 64
"""Edits tried; which side of a pair connects depends on the ports the two ranks listen on."""


def rank1_address_generation(key: str) -> int | None:
    """The generation of the rendezvous of both ranks' group in which ``key`` is rank 1's
    address; ``None`` for any other key."""
    found = re.match(r"gen(\d+)/", key)
    if found is None or not key.endswith("/1"):
        return None
    generation = int(found.group(1))
    return generation if f"/{_group_name(generation, [0, 1])}/" in key else None


class Rendezvous(InterruptibleStore):
    """The job store, except around rank 1's address in the group of both ranks: rank 1 stops
    once it has published it, rank 0 reads it only after that."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        super().__init__(store, None, timedelta(seconds=120))
        self._rank = rank

    def set(self, key, value):
        super().set(key, value)
        generation = rank1_address_generation(key)
        if self._rank == 1 and generation:
            super().set(f"test/published/{generation}", "")
            os.kill(os.getpid(), signal.SIGSTOP)

    def get(self, key):
        generation = rank1_address_generation(key)
        if self._rank == 0 and generation:
            super().get(f"test/stopped/{generation}")
        return super().get(key)


def main() -> None:
    rank, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    timeout = timedelta(seconds=120)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    # A connection of its own, as the failure monitor's: a wait holds its connection.
    monitor_store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("init/", client), rank=rank,
                            world_size=2, timeout=timeout)
    layout = Layout.megatron(tp=1, pp=1, dp=2, num_layers=2, num_microbatches=2)
    registry = GroupRegistry(layout, rank, store=Rendezvous(client, rank), timeout=timeout)
    for generation in range(1, GENERATIONS + 1):
        abort, aborted_at = threading.Event(), []

        def monitor(generation=generation, abort=abort, aborted_at=aborted_at) -> None:
            monitor_store.wait([f"test/stopped/{generation}"])
            time.sleep(DETECTION_DELAY_S)
            aborted_at.append(time.monotonic())
            abort.set()

        if rank == 0:
            threading.Thread(target=monitor, daemon=True).start()
        try:
            registry.edit((), layout, EditMode.INPLACE, broken=member_lists(group_specs(layout)),
                          generation=generation, abort=abort)
        except Exception as raised:  # what ended rank 0's edit is the result
            if rank != 0:
                raise
            ended = time.monotonic()
            report = {"generation": generation, "error": f"{type(raised).__name__}: {raised}",
                      "after_abort_s": ended - aborted_at[0] if aborted_at else None}
            (out_dir / "rank0.json").write_text(json.dumps(report))
            client.set(f"test/result/{generation}", "ended")
            return
        if rank == 0:
            client.set(f"test/result/{generation}", "ended" if generation == GENERATIONS else "formed")
    if rank == 0:
        (out_dir / "rank0.json").write_text(json.dumps({"error": f"never waited in {GENERATIONS} edits"}))


if __name__ == "__main__":
    main()
