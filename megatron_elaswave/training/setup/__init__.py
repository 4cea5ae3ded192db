"""Setting a job up from the command line: the entry point of ``pretrain_gpt.py``, the
distributed start, the trainer built for a rank launched with the job or joining it."""
