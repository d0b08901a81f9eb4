"""hyperrec.autoac: automatic activation checkpointing under a peak-memory budget.

- :func:`profile`: one instrumented step: per region, per op output, bytes, recompute
  cost, lifetime, whether autograd needs it; the step's memory timeline and peak.
- :func:`plan`: per op output keep / keep packed (MXFP8, FP8, MX4) / recompute, per
  region checkpointed or not, minimising added time subject to the **peak** at every
  position of the step; one global budget split across regions by marginal return,
  per-region budgets, exact (branch and bound) or greedy with a certified gap.
- :func:`apply` (profile + plan + apply in one call) / :func:`apply_plan`: eager
  selective checkpointing and saved-tensor packing, or per-region ``torch.compile``
  (MXINT8 packed saves traced into the compiled graphs where torch supports it).
- :func:`span_free_bound`: the least time any plan within a budget could add, whatever
  its regions (finer spans included): whether marking finer regions could reach a speed
  target at all.
- Safe by construction: random ops replay with the same numbers; collectives are never
  replayed; packed formats only where the measured gradient error is within a bound.
"""

from hyperrec.autoac import reference
from hyperrec.autoac._version import __version__
from hyperrec.autoac.bound import SpanFreeBound, span_free_bound
from hyperrec.autoac.formats import SAVE_FORMATS, SaveFormat
from hyperrec.autoac.planner import (
    Plan,
    PlanConfig,
    RegionPlan,
    partitioner_plan,
    plan,
    price_compiled_saves,
)
from hyperrec.autoac.profiler import (
    Profile,
    ProfileConfig,
    RegionProfile,
    SavedOp,
    StorageLife,
    profile,
)
from hyperrec.autoac.regions import Span, resolve_regions
from hyperrec.autoac.runtime import (
    AutoAC,
    StepMeasurement,
    apply,
    apply_plan,
    calibrate_none,
    compile_mechanism,
    compiled_packing_supported,
    for_compiled_packing,
    measure_step,
    price_compiled,
    remove,
)
from hyperrec.autoac.tracker import MemoryTracker

__all__ = [
    "SAVE_FORMATS",
    "AutoAC",
    "MemoryTracker",
    "Plan",
    "PlanConfig",
    "Profile",
    "ProfileConfig",
    "RegionPlan",
    "RegionProfile",
    "SaveFormat",
    "SavedOp",
    "Span",
    "SpanFreeBound",
    "StepMeasurement",
    "StorageLife",
    "__version__",
    "apply",
    "apply_plan",
    "calibrate_none",
    "compile_mechanism",
    "compiled_packing_supported",
    "for_compiled_packing",
    "measure_step",
    "partitioner_plan",
    "plan",
    "price_compiled",
    "price_compiled_saves",
    "profile",
    "reference",
    "remove",
    "resolve_regions",
    "span_free_bound",
]
