"""A worker that imports what the launcher preloads of megatron-core, and says so."""

import megatron.core.optimizer  # noqa: F401

print("imported megatron.core.optimizer", flush=True)
