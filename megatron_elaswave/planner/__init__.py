"""The elastic planner: pure functions from (layout, failed ranks, cost profile) to a new plan.

No torch, no torch.distributed: everything here runs, and is tested, at any scale on one core.

* :mod:`~megatron_elaswave.planner.profile`: the cost profile JSON (load, save, synthetic);
* :mod:`~megatron_elaswave.planner.job`, :mod:`~megatron_elaswave.planner.cost`: the job and its
  integer per-layer costs;
* :mod:`~megatron_elaswave.planner.graph`: minimax layer partition (pipeline resharding);
* :mod:`~megatron_elaswave.planner.dataflow`: micro-batch assignment (global batch preserved);
* :mod:`~megatron_elaswave.planner.zero`: interleaved ZeRO ownership and migration waves;
* :mod:`~megatron_elaswave.planner.frequency`: per-stage clocks (DVFS) under a power envelope;
* :mod:`~megatron_elaswave.planner.rng`: layout-invariant seeds for stochastic ops;
* :mod:`~megatron_elaswave.planner.replan`: all of the above as one recovery plan;
* :mod:`~megatron_elaswave.planner.predict`, :mod:`~megatron_elaswave.planner.policies`: simulated
  throughput of the plan and of the baseline policies.
"""
