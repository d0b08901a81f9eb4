"""Cost model: alpha-beta collectives per tier, compute, FSDP overlap, and ``plan_mesh``."""

from hyperrec.parallel5d.cost.collectives import (
    BASE_LATENCY_US,
    COLLECTIVES,
    GroupShape,
    bus_bandwidth,
    collective_time,
)
from hyperrec.parallel5d.cost.model import (
    CostOptions,
    DeviceSpec,
    LayerSpec,
    ModelConfig,
    Plan,
    Prediction,
    SparseSpec,
    plan_mesh,
    predict,
)
from hyperrec.parallel5d.cost.presets import gem_scale, history_moments

__all__ = [
    "BASE_LATENCY_US",
    "COLLECTIVES",
    "CostOptions",
    "DeviceSpec",
    "GroupShape",
    "LayerSpec",
    "ModelConfig",
    "Plan",
    "Prediction",
    "SparseSpec",
    "bus_bandwidth",
    "collective_time",
    "gem_scale",
    "history_moments",
    "plan_mesh",
    "predict",
]
