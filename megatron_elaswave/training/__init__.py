"""GPT pretraining on megatron-core's public API, with Megatron-LM's flags (``pretrain_gpt.py``).

Its rooms, each importing only those listed before it: :mod:`.arguments` (the command line),
:mod:`.step` (the model, data and loop of one training step, and the state it leaves),
:mod:`.checkpointing` (checkpoints on disk), :mod:`.recovery` (the elastic trainer and what it
does after a failure, a grow or a layer move) and :mod:`.setup` (the job built from the command
line)."""
