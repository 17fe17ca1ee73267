"""A gradient from autograd to ``step()``: which optimizer owns a parameter, what ``.grad``
holds after the optimizer took it in, the cooperation with DDP, the backward-time reduction
scheduler, parameters without a gradient, the factor (unscale, average, clip), fp16 loss
scaling, and the link to the other pipeline stages."""

from dtypeplan.optimizers.grads.loss_scaler import LossScaler, MinimumLossScaleError
from dtypeplan.optimizers.grads.pipeline import (
    PipelineLink,
    backward_passes_per_step,
    note_stages,
    pipeline_group_of,
    remember,
    remembered,
    schedule_refusal,
    stage_local_refusal,
    unannounced_pipeline,
)

__all__ = [
    "LossScaler",
    "MinimumLossScaleError",
    "PipelineLink",
    "backward_passes_per_step",
    "note_stages",
    "pipeline_group_of",
    "remember",
    "remembered",
    "schedule_refusal",
    "stage_local_refusal",
    "unannounced_pipeline",
]
