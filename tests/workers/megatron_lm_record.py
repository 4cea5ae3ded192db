"""Run a Megatron-LM training script as ``python -m megatron_elaswave.run_megatron_lm`` does, and
record what each ``train_step`` hands Megatron-LM's ``train()``.

    megatron_lm_record.py RECORD.jsonl SCRIPT [ARGS...]

The last rank (the one that prints Megatron-LM's log line, on the last pipeline stage) appends
one JSON line per iteration to ``RECORD.jsonl``: ``{"iteration", "lm_loss", "grad_norm"}`` at
full precision (the log line rounds the grad norm to three decimals). Nothing else changes:
``train_step`` is Megatron-LM's own (through the adaptor's ``--elastic`` hook, which calls
straight through without ``--elastic``).
"""

import functools
import json
import os
import sys

import torch.distributed as dist


def recording(train_step, record: str):
    @functools.wraps(train_step)
    def recorded_train_step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        loss, grad_norm = result[0], result[5]
        if loss and dist.get_rank() == dist.get_world_size() - 1:
            entry = {"iteration": kwargs["iteration"] + 1, "lm_loss": float(loss["lm loss"]),
                     "grad_norm": None if grad_norm is None else float(grad_norm)}
            with open(record, "a") as out:
                out.write(json.dumps(entry) + "\n")
        return result

    return recorded_train_step


def main() -> None:
    record, script, *script_args = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # a checkout's root
    import megatron_elaswave.megatron_lm.adaptor  # noqa: F401  (adapts Megatron-LM on import)
    import megatron.training.training as training
    from megatron_elaswave.megatron_lm import runner

    training.train_step = recording(training.train_step, record)
    sys.argv = ["run_megatron_lm", script, *script_args]
    runner.main()


if __name__ == "__main__":
    main()
