"""What runs inside every worker of an elastic job, below the training loop: the failure
monitor (:mod:`.monitor`) and the agreement on what to do (:mod:`.agreement`), the process
groups and communicators edited in place (:mod:`.world`, :mod:`.communicator`), the in-memory
snapshots (:mod:`.snapshot`), fault injection (:mod:`.faults`), clock control (:mod:`.dvfs`) and
the layout-invariant dropout RNG (:mod:`.dropout_rng`)."""
