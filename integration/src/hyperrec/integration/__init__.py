"""hyperrec.integration: a GEM-style ranking model trained end to end on the hyperrec stack.

- Configs: :class:`Preset` = :class:`DataConfig` + :class:`ModelConfig` +
  :class:`TrainConfig`; presets ``micro``, ``tiny``, ``small``, ``h200``, ``gem``
  (:func:`get_preset`).
- Data: :class:`SyntheticRecsysData` (power-law histories, Zipf ids, hidden ground truth,
  every sample a pure function of its index) producing jagged :class:`Batch` es.
- Model: :class:`GEMModel` (embeddings, HSTU-style GDPA/block-attention tower, PMA,
  candidate cross attention, DCN-v2, CTR/CVR heads with ESMM).
- Training: :class:`Trainer` (BBS batching, ``hyperrec.parallel5d.fully_shard`` or FSDP2
  on ``hyperrec.parallel5d``'s 5-D mesh (:func:`build_mesh`) under torchrun, sharded
  embedding tables with lazy row optimizers (:func:`sharded_tables`), ``hyperrec.autoac``
  per sequence layer, DCP checkpoints with exact resume, eval against popularity and
  ground truth); CLI ``hyperrec-train``.
- Metrics: :func:`auc`, :func:`normalized_entropy`, :func:`calibration`; MFU from
  :func:`model_flops` (analytic FLOPs of a step's jagged lengths).
- Speed: ``TrainConfig.impl="naive"`` (the padded-PyTorch baseline), fused table lookup,
  compiled small-op regions, MXFP8 MLPs, a :class:`StepLoader` that builds, validates,
  pins and copies batches off the critical path.
"""

from hyperrec.integration._version import __version__
from hyperrec.integration.baseline import PopularityBaseline
from hyperrec.integration.config import (
    PRESETS,
    DataConfig,
    ModelConfig,
    Preset,
    TrainConfig,
    get_preset,
    override,
)
from hyperrec.integration.data import EVAL, TRAIN, Batch, SyntheticRecsysData
from hyperrec.integration.distributed import build_mesh, init_distributed, parallelize
from hyperrec.integration.flops import FlopCount, model_flops, peak_tflops
from hyperrec.integration.loader import StepLoader
from hyperrec.integration.metrics import auc, calibration, log_loss, normalized_entropy
from hyperrec.integration.model import GEMModel, esmm_loss, estimate_memory, sharded_tables
from hyperrec.integration.pipeline import TrainStream
from hyperrec.integration.trainer import RunResult, StepRecord, Trainer

__all__ = [
    "EVAL",
    "FlopCount",
    "PRESETS",
    "TRAIN",
    "Batch",
    "DataConfig",
    "GEMModel",
    "ModelConfig",
    "PopularityBaseline",
    "Preset",
    "RunResult",
    "StepRecord",
    "StepLoader",
    "SyntheticRecsysData",
    "TrainConfig",
    "TrainStream",
    "Trainer",
    "__version__",
    "auc",
    "build_mesh",
    "calibration",
    "esmm_loss",
    "estimate_memory",
    "get_preset",
    "init_distributed",
    "log_loss",
    "model_flops",
    "normalized_entropy",
    "override",
    "parallelize",
    "peak_tflops",
    "sharded_tables",
]
