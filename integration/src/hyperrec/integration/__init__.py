"""hyperrec.integration: a GEM-style ranking model trained end to end on the hyperrec stack.

- Configs: :class:`Preset` = :class:`DataConfig` + :class:`ModelConfig` +
  :class:`TrainConfig`; presets ``micro``, ``tiny``, ``small``, ``h200``, ``gem``
  (:func:`get_preset`).
- Data: any :class:`DataSource` (a small protocol) producing jagged :class:`Batch` es, with
  its :class:`DataSchema`: :class:`SyntheticRecsysData` (power-law histories, Zipf ids,
  hidden ground truth) or :class:`EventLogSource` (CSV / Parquet interaction logs:
  per-user histories, id vocabularies, time or per-user splits).
- Model: :class:`GEMModel` (embeddings, HSTU-style GDPA/block-attention tower, PMA,
  candidate cross attention, DCN-v2, CTR/CVR heads with ESMM, or CTR only).
- Training: :class:`Trainer` (BBS batching, ``hyperrec.parallel5d.fully_shard`` or FSDP2
  on ``hyperrec.parallel5d``'s 5-D mesh (:func:`build_mesh`) under torchrun, sharded
  embedding tables with lazy row optimizers (:func:`sharded_tables`), ``hyperrec.autoac``
  per sequence layer, epochs, validation and early stopping, atomic verified DCP
  checkpoints with exact resume (also onto another world size), a non-finite-step policy,
  test evaluation against popularity, logistic regression and the ground truth); CLI
  ``hyperrec-train``.
- Metrics: :func:`auc`, :func:`gauc`, :func:`normalized_entropy`, :func:`calibration`; MFU
  from :func:`model_flops` (analytic FLOPs of a step's jagged lengths).
- Speed: ``TrainConfig.impl="naive"`` (the padded-PyTorch baseline), fused table lookup,
  compiled small-op regions, MXFP8 MLPs, a :class:`StepLoader` that builds, validates,
  pins and copies batches off the critical path.
"""

from hyperrec.integration._version import __version__
from hyperrec.integration.baseline import LogisticRegressionBaseline, PopularityBaseline
from hyperrec.integration.checkpoint import CheckpointError
from hyperrec.integration.config import (
    PRESETS,
    DataConfig,
    DataSchema,
    EventLogConfig,
    ModelConfig,
    Preset,
    TrainConfig,
    get_preset,
    override,
)
from hyperrec.integration.data import (
    EVAL,
    TEST,
    TRAIN,
    VALID,
    Batch,
    DataSource,
    SyntheticRecsysData,
)
from hyperrec.integration.distributed import build_mesh, init_distributed, parallelize
from hyperrec.integration.eventlog import (
    EventLogError,
    EventLogSource,
    prepare_event_log,
    write_example_log,
)
from hyperrec.integration.faults import NonFiniteError
from hyperrec.integration.flops import FlopCount, model_flops, peak_tflops
from hyperrec.integration.loader import StepLoader
from hyperrec.integration.metrics import auc, calibration, gauc, log_loss, normalized_entropy
from hyperrec.integration.model import GEMModel, esmm_loss, estimate_memory, sharded_tables
from hyperrec.integration.pipeline import TrainStream
from hyperrec.integration.trainer import RunResult, StepRecord, Trainer

__all__ = [
    "EVAL",
    "FlopCount",
    "PRESETS",
    "TEST",
    "TRAIN",
    "VALID",
    "Batch",
    "CheckpointError",
    "DataConfig",
    "DataSchema",
    "DataSource",
    "EventLogConfig",
    "EventLogError",
    "EventLogSource",
    "GEMModel",
    "LogisticRegressionBaseline",
    "ModelConfig",
    "NonFiniteError",
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
    "gauc",
    "get_preset",
    "init_distributed",
    "log_loss",
    "model_flops",
    "normalized_entropy",
    "override",
    "parallelize",
    "peak_tflops",
    "prepare_event_log",
    "sharded_tables",
    "write_example_log",
]
