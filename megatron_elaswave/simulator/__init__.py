"""Pipeline-schedule simulator: predicts step time, bubbles, throughput and energy of a layout
from per-stage costs, without running anything."""

from megatron_elaswave.simulator.pipeline import PipelineResult, simulate_pipeline
from megatron_elaswave.simulator.step import ReplicaWork, StepPrediction, predict_step

__all__ = ["PipelineResult", "ReplicaWork", "StepPrediction", "predict_step", "simulate_pipeline"]
