"""The training step as megatron-core runs it: the model built for a layout, its data, the loop
with Megatron's log lines, and the state a step leaves (its snapshot, its optimizer state by
global name)."""
