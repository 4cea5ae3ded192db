"""Exit statuses of a training worker, beside 0 (trained to the end)."""

BAD_INPUT = 2
"""A flag, a dataset, a checkpoint or the installed megatron-core cannot be used."""

CANNOT_CONTINUE = 3
"""The survivors of failures cannot hold the model or lost part of its state, or a rank died
before the job held a snapshot to recover from."""

STEP_FAILED = 1
"""An iteration fails however often it is re-run (as Megatron's exit on a non-finite loss)."""

PEER_FAILED = 1
"""Without ``--elastic``, another rank died: the job stops with it."""

JOIN_INTERRUPTED = 1
"""A failure interrupted a replacement's join: the job goes on without it (``--rejoin`` starts
it again)."""

SAVE_FAILED = 4
"""A checkpoint could not be written (``--elastic-save-failures stop``), or the final or
preemption save was not."""
