"""Structure-aware optimizers for ``fully_shard`` parameters (plain tensors work too).

Their states are sharded like their parameters (DTensors with the same placements), so
``state_dict()`` / ``load_state_dict()`` round-trip through ``torch.distributed.checkpoint``
onto any world size.
"""

from hyperrec.parallel5d.optim.adam8bit import AdamW8bit, dequantize_blocks, quantize_blocks
from hyperrec.parallel5d.optim.muon import Muon, newton_schulz

__all__ = ["AdamW8bit", "Muon", "dequantize_blocks", "newton_schulz", "quantize_blocks"]
