"""hyperrec.bbs: Base Batch Shuffling, load-balanced batching of jagged samples.

Data-parallel ranks wait for the slowest one every step. With jagged sequences
(user histories) per-rank step cost varies a lot; BBS evens it out with zero
cross-rank communication by letting each rank deal a window of ``W`` steps of its own
sub-batches so that every step pairs heavy with light ones.

- :func:`shuffle_plan` - the core: plan one window of sub-batch costs.
- :func:`global_shuffle_plan` - the global mode for readers sharing an index.
- :class:`BalancedShuffler` - streaming BBS over any iterable or index-only source,
  with exact resume.
- :class:`BalancedBatchSampler` - a ``torch.utils.data`` batch sampler (local/global).
- :class:`CostBudgetBatcher` - fill each step up to a fixed cost budget instead.
- :class:`CostModel` - linear tokens + quadratic attention cost of jagged lengths.
- :class:`ImbalanceStats`, :func:`per_step_ratios` - per-step max/mean, p99, excess.
- :mod:`hyperrec.bbs.simulate` - the skew simulator (``python -m hyperrec.bbs.simulate``).
"""

from hyperrec.bbs._version import __version__
from hyperrec.bbs.budget import BudgetConfig, CostBudgetBatcher, budget_from_costs
from hyperrec.bbs.cost import CostFn, CostModel
from hyperrec.bbs.metrics import ImbalanceStats, per_step_ratios
from hyperrec.bbs.partition import METHODS, balance
from hyperrec.bbs.plan import global_shuffle_plan, natural_steps, shuffle_plan
from hyperrec.bbs.sampler import BalancedBatchSampler
from hyperrec.bbs.stream import BalancedShuffler, BBSConfig

__all__ = [
    "METHODS",
    "BBSConfig",
    "BalancedBatchSampler",
    "BalancedShuffler",
    "BudgetConfig",
    "CostBudgetBatcher",
    "CostFn",
    "CostModel",
    "ImbalanceStats",
    "__version__",
    "balance",
    "budget_from_costs",
    "global_shuffle_plan",
    "natural_steps",
    "per_step_ratios",
    "shuffle_plan",
]
