"""megatron-elaswave inside Megatron-LM's own training loop (``megatron.training``).

Above the runtime's own training (:mod:`megatron_elaswave.training`, which never imports this
package), as an extension of it: :mod:`.adaptor` checks and patches Megatron-LM on import,
:mod:`.runner` runs an untouched Megatron-LM script through it, :mod:`.hooks` is what the
``--elastic`` hooks in Megatron-LM's loop (``patches.megatron_lm_elastic``) call into, and
:mod:`.job` is the elastic job they drive. Users name the documented entry points,
``megatron_elaswave.megatron_adaptor`` and ``python -m megatron_elaswave.run_megatron_lm``.
"""
