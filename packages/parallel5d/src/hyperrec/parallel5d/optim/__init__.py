"""Structure-aware optimizers for ``fully_shard`` parameters (plain tensors work too)."""

from hyperrec.parallel5d.optim.adam8bit import AdamW8bit, dequantize_blocks, quantize_blocks
from hyperrec.parallel5d.optim.muon import Muon, newton_schulz

__all__ = ["AdamW8bit", "Muon", "dequantize_blocks", "newton_schulz", "quantize_blocks"]
