"""``ProcessGroupCollection`` from groups that already exist, on every supported release.

Checked against megatron-core 0.16.1 (20 fields) and 0.19.2 (25 fields).

megatron-core 0.19 adds the generalized-tensor-parallel ("GTP remat") variants of the data-parallel
and expert groups. With a GTP remat size of 1, the only size megatron-elaswave builds, each is the
group it extends (``dp_cp_gtp_remat`` is ``dp_cp``, and so on), and 0.19's own readers fall back to
the base group when the variant is unset only in some places (``finalize_model_grads``), not all
(``get_megatron_optimizer``'s ``parallel_state`` defaults, the MoE loss logging). So the variants
are always filled in where the release has them.
"""

from __future__ import annotations

import dataclasses

from megatron.core.process_groups_config import ProcessGroupCollection

GTP_REMAT_ALIASES = {
    "dp_cp_gtp_remat": "dp_cp",
    "expt_dp_gtp_remat": "expt_dp",
    "tp_ep_pp_with_egtp_remat": "tp_ep_pp",
}
"""Field a release may add -> the field it equals with a GTP remat size of 1."""

_FIELDS = {f.name for f in dataclasses.fields(ProcessGroupCollection)}


def process_group_collection(**groups) -> ProcessGroupCollection:
    """Megatron's collection of ``groups`` (its field names), with this release's GTP variants.

    megatron-core 0.19 raises ``ValueError`` for a field name it does not have; 0.16.1 drops it.
    """
    for variant, base in GTP_REMAT_ALIASES.items():
        if variant in _FIELDS and base in groups:
            groups.setdefault(variant, groups[base])
    return ProcessGroupCollection(**groups)
