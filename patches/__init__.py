"""Patches of Megatron-Core internals (placeholder)."""
