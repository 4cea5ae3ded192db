"""``import megatron_elaswave.megatron_adaptor``: the documented entry point that adapts
Megatron-LM's own training loop on import (:mod:`megatron_elaswave.megatron_lm.adaptor`)."""

from megatron_elaswave.megatron_lm.adaptor import applied  # noqa: F401
