"""megatron-elaswave: elastic-native hybrid-parallel training for Megatron-Core.

The runtime in this package (launcher, device layer, planner, communicator, snapshots, monitor)
knows nothing of Megatron-Core internals; everything version-specific lives in
:mod:`megatron_elaswave.patches`.
"""

__version__ = "0.1.0"
