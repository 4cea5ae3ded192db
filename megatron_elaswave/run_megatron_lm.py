"""``python -m megatron_elaswave.run_megatron_lm SCRIPT [ARGS...]``: the documented entry point of
the runner (:mod:`megatron_elaswave.megatron_lm.runner`)."""

from megatron_elaswave.megatron_lm.runner import main

if __name__ == "__main__":
    main()
