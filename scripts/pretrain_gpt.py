"""Pretrain a GPT model on Megatron-Core with Megatron-LM's flags; add ``--elastic`` to survive
rank failures without a restart.

Launch with ``elaswave-run --nproc-per-node N scripts/pretrain_gpt.py <flags>``.
"""

from megatron_elaswave.training.setup.pretrain import main

# The guard matters: dist_checkpointing starts a spawn-based process that re-imports this file.
if __name__ == "__main__":
    main()
