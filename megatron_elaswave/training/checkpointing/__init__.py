"""Checkpoints on disk: Megatron's ``torch_dist`` format (``--save``/``--load``), and the durable
ones an elastic job writes in the background from its snapshots."""
